"""The model on this machine: resolve a spec (hub repo id or folder), download, load.

  files.py     the published file names, model folders, the hub cache (no torch)
  download.py  fetching from the hub into its cache, voices.tgz unpacked safely
  device.py    compute device and precision, decided once
  load.py      strict, shape-checked loading of Mimi and the LM
  skeleton.py  modules built for their shapes alone (meta, uninitialised)
  tokenizer.py the text tokenizer: role prompts in, the text stream's pieces out
  model.py     `Model`: all of it together, each part loaded on first use

This package's __init__ imports nothing, so the CLI can name file constants cheaply.
"""
