"""`reply` over many recordings: every input checked before the model loads, `--keep-going`,
`--skip-existing`, and `--manifest` rows with their own personas in one batch, each reply
equal to the same row answered alone."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from conftest import GOLDEN_ASSETS, golden_model_folder, speech_like
from personaplex_cli import errors
from personaplex_cli.manifest import ManifestError, read_manifest
from personaplex_cli.runtime.personas import Personas


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return golden_model_folder(tmp_path_factory.mktemp("batch") / "model")


@pytest.fixture(scope="module")
def reply(run_cli, model_dir, tmp_path_factory):
    voices = tmp_path_factory.mktemp("user-voices")

    def run(*args, **kwargs):
        env = {"PERSONAPLEX_MODEL": model_dir, "PERSONAPLEX_DEVICE": "cpu",
               "PERSONAPLEX_VOICES_DIR": voices, **kwargs.pop("env", {})}
        return run_cli("reply", *args, env=env, **kwargs)

    return run


def offline(model, rows: int):
    """The scheduler `reply` runs on, from runtime.open (FREE pacing), at this process's
    thread count (not one remembered in the user's cache)."""
    import torch

    from personaplex_cli.runtime import open as open_runtime
    from personaplex_cli.runtime.scheduler import Pacing

    return open_runtime(model, None, rows, Pacing.FREE, threads=torch.get_num_threads())

def speech(path: Path, seconds: float, seed: int = 0, rate: int = 24000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, speech_like(seconds, rate, seed), rate, subtype="PCM_16")
    return path


def nan_wav(path: Path) -> Path:
    data = speech_like(1.0)
    data[5000] = np.nan
    sf.write(path, data, 24000, subtype="FLOAT")
    return path


def stderr_of(proc) -> str:
    text = proc.stderr.decode()
    assert "Traceback" not in text, text
    return text


def test_bad_inputs_stop_the_batch_before_the_model_loads(reply, tmp_path):
    """`reply a b bad c -o dir/`: nothing is written, and the bad input is found before the
    model loads (its LM file here is corrupt: loading it would fail with exit 6)."""
    from conftest import golden_model_folder as folder

    broken = folder(tmp_path / "broken")
    (broken / "model.safetensors").unlink()
    (broken / "model.safetensors").write_bytes(b"not a checkpoint")
    inputs = [speech(tmp_path / f"{name}.wav", 0.5, i) for i, name in enumerate("abc")]
    bad = nan_wav(tmp_path / "bad.wav")
    out = tmp_path / "out"
    out.mkdir()
    proc = reply(*inputs[:2], bad, inputs[2], "-o", out, "--seed", "1",
                 env={"PERSONAPLEX_MODEL": broken})
    assert proc.returncode == errors.EXIT_BAD_INPUT, stderr_of(proc)
    assert "bad.wav" in stderr_of(proc) and "NaN" in stderr_of(proc)
    assert "--keep-going" in stderr_of(proc)
    assert len(stderr_of(proc).strip().splitlines()) == 1
    assert list(out.iterdir()) == []


def test_keep_going_then_skip_existing(reply, tmp_path):
    inputs = [speech(tmp_path / f"{name}.wav", 0.6 + 0.3 * i, i)
              for i, name in enumerate("abc")]
    bad = nan_wav(tmp_path / "bad.wav")
    out = tmp_path / "out"
    out.mkdir()
    proc = reply(*inputs[:2], bad, inputs[2], "-o", out, "--seed", "1", "--keep-going",
                 "--json", "-b", "2")
    assert proc.returncode == errors.EXIT_BAD_INPUT, stderr_of(proc)
    assert "1 of 4 input(s) failed" in stderr_of(proc) and "bad.wav" in stderr_of(proc)
    # The last line names what failed; why was said once, as it happened (issue 30.15).
    last = stderr_of(proc).strip().splitlines()[-1]
    assert last.endswith("bad.wav (said above)"), last
    said = [line for line in stderr_of(proc).splitlines() if "bad.wav" in line]
    assert len(said) == 2 and said[0].endswith(": skipped"), said
    assert sorted(p.name for p in out.iterdir()) == ["a.wav", "b.wav", "c.wav"]
    lines = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert sorted((line["status"], Path(line["input"]).name) for line in lines) == [
        ("done", "a.wav"), ("done", "b.wav"), ("done", "c.wav"), ("failed", "bad.wav")]
    assert all(line["frames"] > 0 for line in lines if line["status"] == "done")
    made = {p.name: p.read_bytes() for p in out.iterdir()}

    # The same run without --skip-existing is refused (the outputs exist) ...
    proc = reply(*inputs, "-o", out, "--seed", "1")
    assert proc.returncode == errors.EXIT_OUTPUT, stderr_of(proc)
    # ... with it, the finished ones are left alone and the mended input is answered.
    speech(bad, 0.5, 9)
    proc = reply(*inputs[:2], bad, inputs[2], "-o", out, "--seed", "1", "--skip-existing")
    assert proc.returncode == 0, stderr_of(proc)
    assert "3 of 4 already answered" in stderr_of(proc)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "bad.wav"} == made
    assert (out / "bad.wav").exists()
    # bad.wav is input 2 with seed 1 + 2, as in the first run: alone it gives the same.
    alone = tmp_path / "alone.wav"
    assert reply(bad, alone, "--seed", "3").returncode == 0
    assert alone.read_bytes() == (out / "bad.wav").read_bytes()


def write_manifest(path: Path, rows: list[dict], kind: str) -> Path:
    if kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        fields = sorted({key for row in rows for key in row})
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows(rows)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_manifest_runs_mixed_personas_in_one_batch(reply, tmp_path, kind, golden_model,
                                                    request):
    """Four rows, four personas (a packaged .pt voice, a voice recording given relative to
    the manifest, no voice, another role), in one batch of 4 rows: each reply, its text and
    codes equal the row answered alone, and relative paths are the manifest's folder's."""
    work = tmp_path / "job"
    (work / "voices").mkdir(parents=True)
    (work / "voices" / "me.wav").write_bytes((GOLDEN_ASSETS / "voice_prompt.wav").read_bytes())
    rows = [
        {"input": "in/a.wav", "output": "out/a.wav", "voice": "NATF2", "seed": 4},
        {"input": "in/b.wav", "output": "out/b.wav", "voice": "voices/me.wav",
         "prompt": "You are a pirate.", "text_out": "json"},
        {"input": "in/c.wav", "output": "out/c.wav", "voice": "", "codes_out": "c.npy"},
        {"input": "in/d.wav", "output": "out/d.wav", "prompt": "Be brief.",
         "tail_silence": 0.4},
    ]
    for i, row in enumerate(rows):
        speech(work / row["input"], 0.7 + 0.4 * i, i)
    (work / "out").mkdir()
    manifest = write_manifest(work / f"m.{kind}", rows, kind)
    proc = reply("--manifest", manifest, "-b", "4", "--seed", "10", "--dtype", "fp32",
                 "--sample-format", "f32", cwd=tmp_path)
    assert proc.returncode == 0, stderr_of(proc)
    assert (work / "out" / "b.json").exists() and (work / "c.npy").exists()

    # Each row alone, in-process, through the same engine at batch 1, on one thread as the
    # CLI ran (another thread count rounds the matrix products differently).
    import torch

    from personaplex_cli import batch
    from personaplex_cli.core.sampling import Sampling
    from personaplex_cli.model.tokenizer import DEFAULT_ROLE

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    request.addfinalizer(lambda: torch.set_num_threads(threads))

    jobs = batch.jobs_from_manifest(*read_manifest(str(manifest)), voice="NATF2",
                                    role=DEFAULT_ROLE, seed=10,
                                    tail_silence=0.0, text_out=None, codes_out=None)
    assert [job.seed for job in jobs] == [4, 11, 12, 13]
    personas = Personas(golden_model)
    for job in jobs:
        job.audio = str(tmp_path / f"alone-{Path(job.audio).name}")
        job.text = job.codes = None
        batch.run(offline(golden_model, 1), [job], personas, Sampling(), rate=24000,
                  sample_formats={job.audio: "f32"}, keep_going=False,
                  on_done=lambda done: None, on_failed=lambda failure: None)
        got, _ = sf.read(work / "out" / Path(job.audio).name.removeprefix("alone-"))
        want, _ = sf.read(job.audio)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert len(personas) == 4


def test_manifest_rows_are_checked_before_the_model_loads(reply, tmp_path):
    speech(tmp_path / "in" / "ok.wav", 0.5)
    rows = [{"input": "in/ok.wav", "output": "ok.wav"},
            {"input": "in/missing.wav", "output": "missing.wav"},
            {"input": "in/ok.wav", "output": "v.wav", "voice": "NOBODY"},
            {"input": "in/ok.wav", "output": "p.wav", "prompt": "many words " * 60}]
    manifest = write_manifest(tmp_path / "m.jsonl", rows, "jsonl")
    proc = reply("--manifest", manifest)
    assert proc.returncode == errors.EXIT_BAD_INPUT, stderr_of(proc)
    lines = stderr_of(proc).strip().splitlines()
    assert len(lines) == 3
    assert [line.split(":")[3] for line in lines] == ["2", "3", "4"]  # m.jsonl:LINE
    assert "missing.wav" in lines[0] and "NOBODY" in lines[1] and "context" in lines[2]
    assert not (tmp_path / "ok.wav").exists()

    proc = reply("--manifest", manifest, "--keep-going", "--json")
    assert proc.returncode == errors.EXIT_BAD_INPUT, stderr_of(proc)
    assert "3 of 4 input(s) failed" in stderr_of(proc)
    assert (tmp_path / "ok.wav").exists()
    status = [json.loads(line)["status"] for line in proc.stdout.decode().splitlines()]
    assert sorted(status) == ["done", "failed", "failed", "failed"]


@pytest.mark.parametrize("text,message", [
    ('{"input": "a.wav"}\n', "m.jsonl:1: the row has no output"),
    ('{"input": "a.wav", "output": "b.wav", "vioce": "x"}\n', "unknown field 'vioce'"),
    ('{"input": "a.wav", "output": "b.wav", "seed": "x"}\n', "seed 'x' is not an integer"),
    ('{"input": "a.wav", "output": "b.wav", "seed": 9223372036854775808}\n',
     "m.jsonl:1: seed must be an integer within 0..9223372036854775807"),
    ('{"input": "a.wav", "output": "b.wav", "voice": null}\n', "m.jsonl:1: voice is null"),
    ('\n{"input": "a.wav", "output": "b.wav", "tail_silence": -1}\n', "m.jsonl:2: tail_silence"),
    ('{"input": "a.wav", "output": "b.wav"\n', "m.jsonl:1: not JSON"),
    ("", "has no rows"),
])
def test_malformed_manifests(tmp_path, text, message):
    path = tmp_path / "m.jsonl"
    path.write_text(text)
    with pytest.raises(ManifestError, match=message):
        read_manifest(str(path))


def test_csv_manifests(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text('input,output,voice,seed\n"a, b.wav",out.wav,,\n\nc.wav,d.wav,NATM1,3\n')
    rows, folder = read_manifest(str(path))
    assert folder == tmp_path
    assert [(row.line, row.values) for row in rows] == [
        (2, {"input": "a, b.wav", "output": "out.wav", "voice": ""}),
        (4, {"input": "c.wav", "output": "d.wav", "voice": "NATM1", "seed": 3})]
    path.write_text("input,output\na.wav,b.wav,c\n")
    with pytest.raises(ManifestError, match="m.csv:2: more values"):
        read_manifest(str(path))


def test_every_bad_row_is_named_by_its_line_in_one_pass(reply, tmp_path):
    """Field errors, a seed past the largest, a null voice, an output that is a folder and
    outputs two rows share, all reported at once by line, before the model loads; with
    --keep-going the good rows are answered (issue 20.2, 20.5)."""
    speech(tmp_path / "in.wav", 0.5)
    (tmp_path / "folder").mkdir()
    lines = ['{"input": "in.wav", "output": "ok.wav", "seed": 3}',
             '{"input": "in.wav", "output": "big.wav", "seed": 99999999999999999999999}',
             '{"input": "in.wav", "output": "null.wav", "voice": null}',
             '{"input": "in.wav", "output": "folder/"}',
             '{"input": "in.wav", "output": "ok.wav"}',
             '{"input": "in.wav", "output": "typo.wav", "vioce": "NATM1"}']
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    proc = reply("--manifest", manifest, "-p", "Be brief.")
    assert proc.returncode in (errors.EXIT_BAD_INPUT, errors.EXIT_OUTPUT), stderr_of(proc)
    said = stderr_of(proc).strip().splitlines()
    assert [line.split("m.jsonl:")[1].split(":")[0] for line in said] == ["2", "3", "4", "5",
                                                                          "6"]
    assert "seed must be an integer within 0..9223372036854775807" in said[0]
    assert "voice is null" in said[1] and "is a directory" in said[2]
    assert f"{tmp_path / 'ok.wav'} is also an output of {manifest}:1" in said[3]
    assert "stem" not in stderr_of(proc) and "unknown field 'vioce'" in said[4]
    assert not (tmp_path / "ok.wav").exists()

    proc = reply("--manifest", manifest, "-p", "Be brief.", "--keep-going", "--json")
    assert proc.returncode == errors.EXIT_BAD_INPUT, stderr_of(proc)
    assert "5 of 6 input(s) failed" in stderr_of(proc)
    statuses = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [(s["where"].split(":")[-1], s["status"]) for s in statuses] == [
        ("2", "failed"), ("3", "failed"), ("4", "failed"), ("5", "failed"), ("6", "failed"),
        ("1", "done")]
    # Row 1 keeps its own seed: it is the same reply as alone.
    alone = tmp_path / "alone.wav"
    assert reply(tmp_path / "in.wav", alone, "-p", "Be brief.", "--seed", "3").returncode == 0
    assert alone.read_bytes() == (tmp_path / "ok.wav").read_bytes()


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_byte_order_mark_is_skipped(tmp_path, kind):
    """Excel's "CSV UTF-8" starts with a UTF-8 byte order mark (issue 20.5)."""
    path = write_manifest(tmp_path / f"m.{kind}", [{"input": "a.wav", "output": "b.wav"}],
                          kind)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    rows, _ = read_manifest(str(path))
    assert [row.values for row in rows] == [{"input": "a.wav", "output": "b.wav"}]
    with open(path, encoding="utf-8") as stdin:  # on stdin, as Python decodes it
        rows, _ = read_manifest("-", stdin)
    assert [row.values for row in rows] == [{"input": "a.wav", "output": "b.wav"}]


def test_a_killed_manifest_run_leaves_whole_files_and_resumes(model_dir, cli_env, tmp_path):
    """SIGKILL in the middle: every reply in place is whole, none is half-written, and a
    rerun with --skip-existing answers exactly the rest."""
    rows = []
    for i in range(6):
        speech(tmp_path / f"in{i}.wav", 2.0, i)
        rows.append({"input": f"in{i}.wav", "output": f"out{i}.wav", "seed": i})
    manifest = write_manifest(tmp_path / "m.jsonl", rows, "jsonl")
    env = {**cli_env, "PERSONAPLEX_MODEL": str(model_dir), "PERSONAPLEX_DEVICE": "cpu"}
    command = [sys.executable, "-m", "personaplex_cli", "reply", "--manifest", str(manifest),
               "-b", "2", "--json"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    first = proc.stdout.readline()  # one reply is done: kill it in the middle of the rest
    assert json.loads(first)["status"] == "done"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in tmp_path.glob("out*.wav"))
    assert 1 <= len(done) < 6
    for name in done:
        assert sf.info(tmp_path / name).frames == 48000  # whole
    proc = subprocess.run(command + ["--skip-existing"], env=env, capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    statuses = [json.loads(line)["status"] for line in proc.stdout.decode().splitlines()]
    assert statuses.count("skipped") == len(done) and statuses.count("done") == 6 - len(done)
    assert all(sf.info(tmp_path / f"out{i}.wav").frames == 48000 for i in range(6))


def test_a_resumed_run_gives_the_same_bytes(reply, tmp_path):
    """A row answered in a rerun with --skip-existing, where it joins a fresh batch, is
    the same bytes as in the first run, where it took the place of a row that had ended
    (eager fp32 attention would otherwise span the KV slots its batch mates had written)."""
    rows = []
    for i in range(5):
        speech(tmp_path / f"in{i}.wav", 0.4 + 0.3 * (i % 3), i)
        rows.append({"input": f"in{i}.wav", "output": f"out{i}.wav", "text_out": "json"})
    manifest = write_manifest(tmp_path / "m.jsonl", rows, "jsonl")
    proc = reply("--manifest", manifest, "-b", "2", "--seed", "1")
    assert proc.returncode == 0, stderr_of(proc)
    first = {p.name: p.read_bytes() for p in tmp_path.glob("out*")}
    for name in ("out3.wav", "out4.wav"):  # both joined a batch already under way
        (tmp_path / name).unlink()
    proc = reply("--manifest", manifest, "-b", "2", "--seed", "1", "--skip-existing")
    assert proc.returncode == 0, stderr_of(proc)
    assert "3 of 5 already answered" in stderr_of(proc)
    assert {p.name: p.read_bytes() for p in tmp_path.glob("out*")} == first


def test_outputs_at_urls(golden_model, tmp_path):
    """A manifest's outputs may be fsspec URLs (memory:// here; file:// in test_ray.py): a
    side output in FORMAT form goes beside the reply at the URL, the files equal those
    written to local paths, nothing but them is left in the store, an existing one is
    refused without --force, and a scheme no installed package knows is one line."""
    import fsspec

    from personaplex_cli import batch
    from personaplex_cli.outputs import check_output, open_output
    from personaplex_cli.core.sampling import Sampling
    from personaplex_cli.errors import OutputError

    speech(tmp_path / "in.wav", 0.6)
    rows = [{"input": "in.wav", "output": "memory://replies/a.wav", "text_out": "srt",
             "codes_out": "memory://replies/codes/a.mimi", "seed": 2},
            {"input": "in.wav", "output": "local/a.wav", "text_out": "srt",
             "codes_out": "local/a.mimi", "seed": 2}]
    (tmp_path / "local").mkdir()
    manifest = write_manifest(tmp_path / "m.jsonl", rows, "jsonl")
    jobs = batch.jobs_from_manifest(*read_manifest(str(manifest)), voice="NATF2", role="Be brief.",
                                    seed=None, tail_silence=0.0, text_out=None,
                                    codes_out=None)
    assert jobs[0].outputs == ["memory://replies/a.wav", "memory://replies/a.srt",
                               "memory://replies/codes/a.mimi"]
    personas = Personas(golden_model)
    ready, done, failures = batch.check(jobs, personas, force=False, skip_existing=False)
    assert (len(ready), done, failures) == (2, [], [])
    batch.run(offline(golden_model, 2), ready, personas, Sampling(), rate=24000,
              sample_formats={job.audio: "s16" for job in jobs}, keep_going=False,
              on_done=lambda done: None, on_failed=lambda failure: None)
    memory = fsspec.filesystem("memory")
    assert sorted(memory.find("/replies")) == ["/replies/a.srt", "/replies/a.wav",
                                               "/replies/codes/a.mimi"]
    for url, local in zip(jobs[0].outputs, jobs[1].outputs):
        assert memory.cat(url) == Path(local).read_bytes()
    assert jobs[0].complete()

    with pytest.raises(OutputError, match="a.wav exists; use --force"):
        check_output("memory://replies/a.wav", force=False)
    with pytest.raises(OutputError, match="^cannot write nosuch://x.wav: .*nosuch"):
        check_output("nosuch://x.wav", force=False)
    # A failed write leaves neither the file nor its staged copy.
    with pytest.raises(RuntimeError):
        with open_output("memory://replies/b.wav", force=False) as sink:
            sink.write(b"half")
            raise RuntimeError("the reply failed")
    assert sorted(memory.find("/replies")) == ["/replies/a.srt", "/replies/a.wav",
                                               "/replies/codes/a.mimi"]
    memory.rm("/replies", recursive=True)


def test_the_longest_inputs_start_first(golden_model, tmp_path):
    """reply knows each input's length from its header and starts the longest first, so a
    batch ends on short replies (runtime.scheduler.longest_first); with one row, the replies
    finish in that order. A job whose input cannot be probed keeps its turn and fails
    when it comes (a missing file here: reported, the others still answered)."""
    from personaplex_cli import batch
    from personaplex_cli.runtime.rows import longest_first
    from personaplex_cli.core.sampling import Sampling

    assert longest_first(["bb", None, "a", "ccc", "dd"],
                         lambda x: None if x is None else len(x)) == [None, "ccc", "bb", "dd",
                                                                      "a"]
    seconds = [0.3, 1.1, 0.6, 0.9]
    jobs = [batch.Job(i, str(speech(tmp_path / f"in{i}.wav", s, i)),
                      str(tmp_path / f"out{i}.wav"), role="Be brief.")
            for i, s in enumerate(seconds)]
    jobs.append(batch.Job(4, str(tmp_path / "gone.wav"), str(tmp_path / "out4.wav"),
                          role="Be brief."))
    done, failed = [], []
    batch.run(offline(golden_model, 1), jobs, Personas(golden_model), Sampling(),
              rate=24000, sample_formats={job.audio: "s16" for job in jobs}, keep_going=True,
              on_done=lambda d: done.append(d.job.index),
              on_failed=lambda f: failed.append(f.job.index))
    assert failed == [4] and done == [1, 3, 2, 0]
    assert not (tmp_path / "out4.wav").exists()


def test_outputs_of_one_input_that_clash_are_not_blamed_on_stems(tmp_path):
    from personaplex_cli import batch
    from personaplex_cli.errors import OutputError

    out = str(tmp_path / "o.wav")
    with pytest.raises(OutputError) as caught:
        batch.check_distinct_outputs([batch.Job(0, "q.wav", out, text=out)])
    assert "same name" in caught.value.message and "stem" not in caught.value.message
    with pytest.raises(OutputError, match="same stem"):
        batch.check_distinct_outputs([batch.Job(0, "a/q.wav", out), batch.Job(1, "b/q.wav", out)])
