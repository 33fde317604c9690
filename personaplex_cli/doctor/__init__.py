"""What `personaplex doctor` checks: plain functions, each returning `Check`s.

  check.py    the `Check` a check returns, and the exit status of a list of them
  compute.py  Python, torch and its CUDA build, each GPU against the model's memory need
  model.py    the model's files in the hub cache or a folder, and its voices
  hub.py      the Hugging Face token and the disk, for a download still to come
  audio.py    PortAudio, the default audio devices, the echo canceller (for talk)
  serve.py    what `serve` needs beyond the model
  run.py      every check in the order reported (`run_checks`)
  bench.py    `doctor --bench`: random weights at the real dimensions loaded as reply loads,
              frames timed (the one module here that loads weights, imported only for it)

Nothing here prints or downloads, and only bench.py builds weights (random ones): the
model's files are looked at with `stat` and their safetensors headers (model/tensorfile.py), the hub cache is read the way
model/files.py reads it, and huggingface_hub is never imported. The memory figures are
model/memory.py's. torch, sounddevice and the echo canceller's library are imported inside
the checks that need them.

A check's status is one of:
  ok    nothing to do;
  warn  something is missing that some work can do without (no GPU: the file commands still
        run on the CPU; no microphone; no echo canceller: `talk --no-echo-cancel`; no token
        while the model is not downloaded yet);
  fail  something a command needs is broken or missing; `exit_code` says which kind (the
        constants of `errors.py`), and `fix` says what to do about it.
The rule between the two: hardware that is simply absent is a warning that says what still
works; software that is installed wrongly, or a model that is missing, is a failure.

This package's __init__ imports nothing.
"""
