"""Faults users cause without meaning to: generate(assistant="self") under
torch.inference_mode() (first call included: engine, heads and copies built there), a
model or heads made under inference_mode, an earlier failed call, a model left in
train() mode with active dropout (refused before any work, with what to do), and a
measurement cache on disk that cannot be read (one warning naming it, measured again,
rewritten atomically; two processes writing at once)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from hf_selfspec import DecodeConfig, attach_heads
from hf_selfspec.engine.core import EngineConfig
from hf_selfspec.heads.top import random_top_heads

KW = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "enable_grad": torch.enable_grad}


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 40, (1, 20), generator=torch.Generator().manual_seed(seed))


def _expected(ids: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """HF's own greedy generate() on a twin of the model (never attached)."""
    return tiny_model("qwen3", seed=seed, layers=4).generate(ids, attention_mask=torch.ones_like(ids), **KW)


def _with_top_heads(seed: int = 2):
    model = tiny_model("qwen3", seed=seed, layers=4)
    # thresholds 0: every step drafts, so the heads' float16 copies are made and read
    attach_heads(model, random_top_heads(model), decode=DecodeConfig(lookup="first", thresholds=0.0))
    return model


def test_first_call_inside_inference_mode_then_any_mode():
    """The engine, its KV cache and the heads' copies built by a first call inside
    inference_mode serve later calls in any grad mode, each HF's greedy tokens."""
    model = _with_top_heads()
    ids = _ids()
    expected = _expected(ids)
    for mode in ("inference_mode", "no_grad", "inference_mode", "enable_grad", "inference_mode"):
        with MODES[mode]():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
        assert torch.equal(out, expected), mode
    assert model.selfspec_stats.drafted > 0  # the heads drafted (their copies were read)


def test_model_and_heads_made_under_inference_mode():
    """Weights that are inference tensors (no version counter): a model loaded and attached
    inside inference_mode decodes HF's tokens inside and outside it."""
    ids = _ids(1)
    expected = _expected(ids)
    with torch.inference_mode():
        model = _with_top_heads()
        assert model.lm_head.weight.is_inference()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
    assert torch.equal(out, expected)
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW), expected)


def test_weight_copies_follow_normal_weights_and_accept_inference_tensors():
    """The copies' version check: an in-place update of a normal weight is seen; an
    inference tensor (no counter) counts as never updated instead of raising."""
    from hf_selfspec.engine.compact import CompactWeights
    from hf_selfspec.engine.versions import version_counter

    with torch.inference_mode():
        frozen = torch.randn(4, 64)
    assert version_counter(frozen) == 0
    weight = torch.randn(4, 64)
    encoded = []
    compact = CompactWeights([weight, frozen], [0, 1],
                             lambda w: encoded.append(w) or torch.zeros(4, 48, dtype=torch.uint8))
    assert compact.count == 2 and compact.refresh() == 0
    with torch.no_grad():
        weight.add_(1.0)
    assert compact.refresh() == 1 and encoded[-1] is weight


def test_a_failed_call_inside_inference_mode_does_not_poison_the_model():
    class Raising:
        def put(self, value):
            raise RuntimeError("streamer failed")

        def end(self):
            pass

    model = _with_top_heads()
    ids = _ids(2)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="streamer failed"):
        model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", streamer=Raising(), **KW)
    expected = _expected(ids)
    for mode in ("no_grad", "inference_mode"):
        with MODES[mode]():
            assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW),
                               expected), mode


# ---- train() mode --------------------------------------------------------------------------

def _gpt2(dropout: float):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=512, n_embd=64, n_layer=2, n_head=4, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config)


def test_train_mode_with_dropout_is_refused_before_any_work():
    model = attach_heads(_gpt2(0.1).train(), heads=False)
    ids = _ids()
    with pytest.raises(ValueError, match=r"training mode with active dropout \(dropout in .*model\.eval\(\)"):
        model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
    assert model._selfspec.engine is None  # refused before the engine was built
    # attention dropout has no module: the config's rate is read
    llama = tiny_model("llama")
    llama.config.attention_dropout = 0.1
    attach_heads(llama.train(), heads=False)
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 in its config.*model\.eval\(\)"):
        llama.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
    # what the message says to do
    llama.eval()
    assert llama.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW).shape[1] > ids.shape[1]


@pytest.mark.parametrize("build", [lambda: _gpt2(0.0), lambda: tiny_model("llama")], ids=["gpt2", "llama"])
def test_train_mode_without_active_dropout_decodes_hf_tokens(build):
    ids = _ids(3)
    reference = build().train()
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), **KW)
    model = attach_heads(build().train(), heads=False)
    assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW), expected)


# ---- the measurement cache on disk -------------------------------------------------------

@pytest.fixture
def cache_folder(tmp_path, monkeypatch):
    folder = tmp_path / "selfspec_cache"
    monkeypatch.setenv("HF_SELFSPEC_CACHE", str(folder))
    monkeypatch.delenv("HF_SELFSPEC_NO_CACHE", raising=False)
    return folder


def _cache(key="a"):
    from hf_selfspec.engine.cache import MeasurementCache

    return MeasurementCache({"test": key}, ("fixed", "kernel"), width=8)


def _bad_entry() -> dict:
    """An entry of the right shape whose every part is wrong: types, names, values."""
    return {"layout": ["kernel"], "prefill": "both", "step_costs": {"kernel@64": {"costs": [1.0, 1.0, -3.0]}},
            "attention": {"kernel@64": float("inf")}, "batch_costs": [1]}


CORRUPT = {
    "bytes": b"\xff\xfe\x00\x9c" * 64 + bytes(range(256)),
    "bad_encoding": '{"format": 1, "entries": {}, "note": "caf\u00e9"}'.encode("latin-1"),
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000,
    "truncated": b'{"format": 1, "entries": {"x": {"layout": "ker',
    "huge_integer": b'{"format": 1, "entries": {"x": ' + b"9" * 10_000 + b"}}",
    "wrong_types": json.dumps({"format": 1, "entries": [["kernel"]]}).encode(),
    "wrong_format": json.dumps({"format": "1", "entries": {}}).encode(),
    "oversized": b" " * (5 << 20),
    "bad_values": "BAD_ENTRY",
}


def _write_corrupt(path: Path, name: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if CORRUPT[name] == "BAD_ENTRY":  # our own entry, every part of it wrong
        digest = _cache().digest
        path.write_text(json.dumps({"format": 1, "entries": {digest: _bad_entry()}}, allow_nan=True))
    else:
        path.write_bytes(CORRUPT[name])


@pytest.mark.parametrize("name", CORRUPT)
def test_an_unreadable_cache_is_dropped_with_one_warning_and_rewritten(cache_folder, name):
    from hf_selfspec.engine.cache import FILE_NAME

    path = cache_folder / FILE_NAME
    _write_corrupt(path, name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = _cache()
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and str(path) in said[0] and "ignored" in said[0], said
    assert cache.layout is None and cache.prefill is None
    assert cache.step_costs("kernel", 64) is None and cache.attention_seconds("kernel", 64) is None
    # rewritten at once without what could not be read: the next process reads it quietly
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["format"] == 1 and cache.digest in data["entries"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _cache().layout is None
    # measured again: stored and read back
    cache.store_layout("kernel")
    cache.store_attention_seconds("kernel", 64, 1e-6)
    again = _cache()
    assert again.layout == "kernel" and again.attention_seconds("kernel", 64) == 1e-6
    assert sorted(p.name for p in cache_folder.iterdir()) == [FILE_NAME, FILE_NAME + ".lock"]  # no temp files


def test_generate_measures_again_over_random_bytes(cache_folder):
    """Through the public entry point: random bytes in the cache give HF's tokens, one
    warning naming the file, and a valid file written back."""
    from hf_selfspec.engine.cache import FILE_NAME

    path = cache_folder / FILE_NAME
    _write_corrupt(path, "bytes")
    ids = _ids(4)
    expected = tiny_model("llama", seed=3).generate(ids, attention_mask=torch.ones_like(ids), **KW)
    # the fixed layout: no layout timing (the step costs are still measured and written)
    model = attach_heads(tiny_model("llama", seed=3), heads=False, engine=EngineConfig(row_layout="fixed"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant="self", **KW)
    assert torch.equal(out, expected)
    said = [str(w.message) for w in caught if "measurement cache" in str(w.message)]
    assert len(said) == 1 and str(path) in said[0], said
    entries = json.loads(path.read_text(encoding="utf-8"))["entries"]
    assert len(entries) == 1 and next(iter(entries.values()))["step_costs"]


REPO = Path(__file__).resolve().parent.parent
# A child process loads the one module under test from its file: importing the package
# (transformers) would cost each child seconds. The code run is the module's own.
LOAD = """
import importlib.util
def load(path):
    spec = importlib.util.spec_from_file_location("module_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
"""

WRITER = LOAD + """
import sys, time
from pathlib import Path
MeasurementCache = load(CACHE_PY).MeasurementCache
name, start = sys.argv[1], Path(sys.argv[2])
print("ready", flush=True)  # imported: both start writing together
while not start.exists():
    time.sleep(0.005)
cache = MeasurementCache({"writer": name}, ("fixed", "kernel"), width=8)
for i in range(100):
    cache.store_attention_seconds("kernel", i, 1e-6 * (i + 1))
    MeasurementCache({"writer": "reader"}, ("fixed", "kernel"), width=8)  # reads while the other writes
""".replace("CACHE_PY", repr(str(REPO / "hf_selfspec" / "engine" / "cache.py")))


def test_two_processes_writing_at_once_keep_both_entries(cache_folder, tmp_path):
    """Two processes storing measurements at the same time: every read sees a whole file
    (no warning), and neither drops the other's entry."""
    from hf_selfspec.engine.cache import FILE_NAME, MeasurementCache

    start = tmp_path / "start"
    writers = [subprocess.Popen([sys.executable, "-W", "error::RuntimeWarning", "-c", WRITER, name, str(start)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("one", "two")]
    assert [writer.stdout.readline().strip() for writer in writers] == ["ready", "ready"]
    start.touch()
    for writer in writers:
        _, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in ("one", "two"):
            cache = MeasurementCache({"writer": name}, ("fixed", "kernel"), width=8)
            assert [cache.attention_seconds("kernel", i) for i in range(100)] == [1e-6 * (i + 1) for i in range(100)]
    assert sorted(p.name for p in cache_folder.iterdir()) == [FILE_NAME, FILE_NAME + ".lock"]


# ---- the C++ kernel's build lock -----------------------------------------------------------

HOLDER = LOAD + """
import sys, time
from pathlib import Path
from torch.utils.file_baton import FileBaton
build_lock = load(CPU_ROWS_PY).build_lock
folder = Path(sys.argv[1])
with build_lock(folder):
    FileBaton(str(folder / "lock")).try_acquire()  # torch's own lock, as its builder takes it
    print("held", flush=True)
    time.sleep(600)  # building: killed here
""".replace("CPU_ROWS_PY", repr(str(REPO / "kernels" / "cpu_rows.py")))


@pytest.fixture
def build_folder(tmp_path, monkeypatch):
    """An empty build folder of the kernel's layout (build_directory) under a temporary root."""
    from hf_selfspec.kernels.cpu_rows import build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    folder = build_directory("selfspec_lock_test")
    assert folder.is_dir() and tmp_path in folder.parents
    return folder


@pytest.fixture
def holder(build_folder):
    """A live process holding the build lock of `build_folder` mid-build (torch's `lock` file
    made); the test kills it with SIGKILL. Killed at the end in any case."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(build_folder)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _kill(process) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL


def test_a_lock_left_by_a_killed_build_is_taken_over_at_once(build_folder, holder, monkeypatch):
    """The process building the kernel is killed (SIGKILL): the next load takes its lock over
    at once with one warning and loads the finished build without waiting (here a stand-in
    for torch's load_inline; the locking is the real loader's)."""
    import torch.utils.cpp_extension
    from hf_selfspec.kernels import cpu_rows
    from torch.utils.file_baton import FileBaton

    _kill(holder)
    torch_lock = build_folder / "lock"
    assert torch_lock.exists()  # what a killed build leaves: torch itself would wait on it for ever

    def load_inline(name, build_directory, **kwargs):
        # what torch's builder does first: take its own lock, which must be free now
        baton = FileBaton(str(Path(build_directory) / "lock"))
        assert baton.try_acquire(), "torch's lock left by the killed build was not taken over"
        baton.release()
        return "the finished build"

    if not cpu_rows.cpu_supports_kernel():
        pytest.skip("the kernel needs an AVX2/FMA CPU: the loader stops before the lock")
    monkeypatch.setattr(cpu_rows, "build_directory", lambda: build_folder)
    monkeypatch.setattr(cpu_rows, "_build_needed", lambda folder, sources: False)  # built: no compile message
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", load_inline)
    cpu_rows._load_module.cache_clear()
    try:
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = cpu_rows._load_module()
        assert module == "the finished build", cpu_rows.build_error()
    finally:
        cpu_rows._load_module.cache_clear()  # the next caller loads the real kernel
    assert time.monotonic() - start < 5
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "taking over" in said[0] and str(torch_lock) in said[0] and "gone" in said[0], said
    assert not torch_lock.exists()


def test_a_live_build_is_waited_on_saying_so_at_once(build_folder, holder):
    """A live process holding the lock: the wait is announced at once (whose, where, for how
    long at most), ends in a clear error past its limit, and ends as soon as the holder does
    (here killed mid-build: its torch lock is then taken over)."""
    from hf_selfspec.kernels.cpu_rows import BuildLockTimeout, build_lock

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timeout = pytest.raises(BuildLockTimeout, match=rf"process {holder.pid} held .* for more than 1 s.*not loaded")
        with timeout, build_lock(build_folder, max_wait=1.0):
            pass
    said = [str(w.message) for w in caught]
    assert len(said) == 1, said
    assert f"process {holder.pid} is building or loading" in said[0] and str(build_folder) in said[0]
    assert "at most 1 s" in said[0]

    threading.Timer(0.5, _kill, (holder,)).start()
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with build_lock(build_folder, max_wait=60):
            held = time.monotonic() - start
    assert held < 10  # when the holder ended, not at the limit
    said = [str(w.message) for w in caught]
    assert len(said) == 2 and "waiting for it" in said[0] and "taking over" in said[1], said
    # released on leaving: taken again at once, quietly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with build_lock(build_folder, max_wait=0.1):
            pass


# ---- the converted default model in the cache folder ---------------------------------------

def test_a_damaged_converted_default_model_is_converted_again(cache_folder, monkeypatch):
    """The default model's converted copy (under the same cache folder): a damaged weights
    file is set aside with one warning naming the folder, and the model converted again
    (here a tiny stand-in for the GGUF conversion)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from hf_selfspec import defaults

    converted = []

    def convert(target):
        converted.append(target)
        tiny_model("llama").save_pretrained(target)
        vocab = {"<unk>": 0, "a": 1}
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")))
        tokenizer.save_pretrained(target)

    monkeypatch.setattr(defaults, "_convert_gguf", convert)
    defaults.load_default_model_and_tokenizer()  # its weights map the file: not read after the damage
    weights = defaults.default_model_dir() / "model.safetensors"
    assert len(converted) == 1 and weights.is_file()
    weights.write_bytes(b"\xff" * 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again, _ = defaults.load_default_model_and_tokenizer()
    said = [str(w.message) for w in caught if "converted default model" in str(w.message)]
    assert len(said) == 1 and str(weights.parent) in said[0], [str(w.message) for w in caught]
    assert len(converted) == 2
    expected = tiny_model("llama").state_dict()
    assert all(torch.equal(expected[name], value) for name, value in again.state_dict().items())
    assert sorted(p.name for p in cache_folder.iterdir()) == [weights.parent.name]  # nothing left aside
