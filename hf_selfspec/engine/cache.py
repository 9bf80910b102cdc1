"""On-disk cache of what the engine measured about this machine: the row layout `auto`
chose and the step costs of that layout, so a later process (or a bigger KV cache) pays
neither the product timing nor the step-cost timing again.

An entry is keyed by everything the measurements depend on: the CPU model, torch's thread
count, the model's shape, dtype and device type, the torch and package versions, the C++
kernel source and whether it loads here, and the engine width. Any change gives another key
(a new measurement); stale entries are dropped oldest first beyond `MAX_ENTRIES`.

Where: `$HF_SELFSPEC_CACHE/measurements.json`, else `$XDG_CACHE_HOME/hf_selfspec/`, else
`~/.cache/hf_selfspec/`. Off: `HF_SELFSPEC_NO_CACHE=1` or `EngineConfig(measurement_cache=False)`.
The file is untrusted input (a crash, a disk error, another program, a user's edit): any
content that cannot be read (bytes that are not UTF-8, JSON that does not parse or nests too
deep, wrong types or values, a file larger than any cache this module writes) is ignored with
one warning naming the file, never used: what it held is measured again, and the file is
rewritten without it at once. Every write goes to a temporary file in the same folder, then
replaces the cache (os.replace), so a process killed mid-write leaves the old file whole;
writers in several processes take turns (an advisory lock on a `.lock` file beside it), so
none drops another's entry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import math
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
FILE_NAME = "measurements.json"
MAX_ENTRIES = 64  # models x machines x widths one user meets; oldest dropped first
PREFILLS = ("hf", "engine")  # what `auto` may pick (EngineConfig.prefill)
# plausibility bounds of a cached measurement (anything outside is corrupt)
MAX_STEP_COST = 1000.0  # W rows at most this many 1-row steps
MAX_ROW_SECONDS = 3600.0
# MAX_ENTRIES entries of a few KB each: anything much larger was not written by this module
MAX_FILE_BYTES = 4 << 20


def cache_dir() -> Path:
    explicit = os.environ.get("HF_SELFSPEC_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hf_selfspec"


def disabled_by_env() -> bool:
    return os.environ.get("HF_SELFSPEC_NO_CACHE", "") not in ("", "0")


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; platform's answer elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def _software() -> dict[str, str]:
    from hf_selfspec._version import __version__
    from hf_selfspec.kernels.cpu_rows import source_digest

    try:  # every section of the kernel's source: an edit to any one is another kernel
        kernel = source_digest()[:16]
    except OSError:
        kernel = "missing"
    return {"torch": torch.__version__, "package": __version__, "kernel_source": kernel}


def machine_key(view, width: int) -> dict[str, Any]:
    """What the layout choice and the step costs of `view` (a LayeredModel) depend on."""
    lw = view.layers[0]
    linears = [lin for layer in view.layers for lin in layer.linears]
    return {
        "cpu": cpu_model(), "threads": torch.get_num_threads(), **_software(),
        "model_type": view.config.model_type, "layers": view.num_layers,
        "hidden": view.hidden_size, "heads": view.num_heads, "kv_heads": view.num_kv_heads,
        "head_dim": view.head_dim, "intermediate": next((lw.intermediate_size for lw in view.layers if lw.has_mlp), 0),
        "vocab": view.vocab_size, "qk_norm": lw.q_norm is not None,
        "biases": any(lin.bias is not None for lin in linears),
        "dtype": str(view.dtype), "device": view.device.type, "width": width,
        # a choice made without the kernel (no compiler yet) must not outlive its absence
        "cpu_kernel": _cpu_kernel_loads() if view.device.type == "cpu" else None,
    } | ({} if view.placement is None else {"placement": view.placement.key()})


def _cpu_kernel_loads() -> bool:
    from hf_selfspec.kernels.cpu_rows import load_rows_linear

    return load_rows_linear() is not None


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def read_entries(path: Path, problems: list[str]) -> dict[str, Any]:
    """The entries by digest of the cache file `path`; {} where it is missing or cannot be
    read, what was wrong then appended to `problems`. Never raises for its content."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as err:
        problems.append(f"cannot be read ({err})")
        return {}
    if len(raw) > MAX_FILE_BYTES:
        problems.append(f"is larger than {MAX_FILE_BYTES} bytes (not a cache this module wrote)")
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        problems.append(f"is not UTF-8 text ({err.reason} at byte {err.start})")
        return {}
    except ValueError as err:  # json.JSONDecodeError; an integer too long to convert
        problems.append(f"is not valid JSON ({err})")
        return {}
    except RecursionError:
        problems.append("nests too deep to be read")
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        problems.append(f"is not a format-{FORMAT} measurement cache")
        return {}
    return data["entries"]


class MeasurementCache:
    """The cached measurements of one key (see module docstring). Reads the file once at
    construction (and rewrites it at once without what could not be read); every `store_*`
    merges this entry into the file as it is then, and replaces it atomically."""

    def __init__(self, key: dict[str, Any], layouts: tuple[str, ...], width: int, enabled: bool = True):
        self.enabled = enabled and not disabled_by_env()
        self.key = key
        self.digest = _digest(key)
        self.path = cache_dir() / FILE_NAME
        self._layouts = layouts
        self._width = width
        self.entry: dict[str, Any] = {}
        self._problems: list[str] = []  # what could not be read, said in one warning
        if self.enabled:
            self.entry = self._valid_entry(self._read().get(self.digest))
            if self._problems:
                warnings.warn(f"the hf_selfspec measurement cache {self.path} {'; '.join(self._problems)}: "
                              "ignored (the engine measures it again; the file is rewritten without it)",
                              RuntimeWarning, stacklevel=3)
                self._write()

    # ---- reading (untrusted input) ---------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        return read_entries(self.path, self._problems)

    def _valid_entry(self, entry: Any) -> dict[str, Any]:
        """The entry's valid parts; a wrong part is dropped with a warning."""
        if entry is None:
            return {}
        if not isinstance(entry, dict):
            self._warn("has an entry that is not an object")
            return {}
        valid: dict[str, Any] = {}
        for choice, known, what in (("layout", self._layouts, "row layout"), ("prefill", PREFILLS, "prefill")):
            if choice in entry:
                if entry[choice] in known:
                    valid[choice] = entry[choice]
                else:
                    self._warn(f"names an unknown {what} {_short(entry[choice])}")
        sections = (("step_costs", "step costs", self._valid_costs),
                    ("attention", "attention cost", self._valid_seconds),
                    ("batch_costs", "batch step costs", self._valid_batch_costs))
        for section, what, check in sections:
            found = entry.get(section, {})
            if not isinstance(found, dict):
                self._warn(f"has {what} that are not an object")
                found = {}
            valid[section] = {}
            for name, value in found.items():
                if check(value):
                    valid[section][name] = value
                else:
                    self._warn(f"has invalid {what} for {_short(name)}")
        return valid

    @staticmethod
    def _valid_seconds(value: Any) -> bool:
        return type(value) in (int, float) and math.isfinite(value) and 0.0 <= value <= MAX_ROW_SECONDS

    @staticmethod
    def _valid_batch_costs(value: Any) -> bool:
        """{"rows": [n increasing from 1], "costs": [cost of n rows in 1-row steps, from 1.0]}"""
        if not isinstance(value, dict):
            return False
        rows, costs = value.get("rows"), value.get("costs")
        if not isinstance(rows, list) or not isinstance(costs, list) or not rows or len(rows) != len(costs):
            return False
        if not all(type(n) is int and 1 <= n <= 4096 for n in rows) or rows[0] != 1:
            return False
        if any(b <= a for a, b in itertools.pairwise(rows)):
            return False
        if not all(type(c) in (int, float) and math.isfinite(c) and 1.0 <= c <= MAX_STEP_COST for c in costs):
            return False
        return costs[0] == 1.0 and all(b >= a for a, b in itertools.pairwise(costs))

    def _valid_costs(self, value: Any) -> bool:
        if not isinstance(value, dict):
            return False
        costs, seconds = value.get("costs"), value.get("one_row_seconds")
        if not isinstance(costs, list) or len(costs) != self._width + 1:
            return False
        if not all(type(c) in (int, float) and math.isfinite(c) and 1.0 <= c <= MAX_STEP_COST for c in costs):
            return False
        if costs[0] != 1.0 or costs[1] != 1.0 or any(b < a for a, b in itertools.pairwise(costs[1:])):
            return False
        return type(seconds) in (int, float) and math.isfinite(seconds) and 0.0 < seconds <= MAX_ROW_SECONDS

    def _warn(self, what: str) -> None:
        self._problems.append(what)

    # ---- the entry -------------------------------------------------------------------------

    @property
    def layout(self) -> str | None:
        """The layout `auto` chose before for this key, or None."""
        return self.entry.get("layout")

    def step_costs(self, layout: str, context: int) -> tuple[tuple[float, ...], float] | None:
        """(step costs, one-row seconds) measured before for `layout` at key limit `context`."""
        value = self.entry.get("step_costs", {}).get(f"{layout}@{context}")
        return None if value is None else (tuple(float(c) for c in value["costs"]), float(value["one_row_seconds"]))

    def batch_costs(self, layout: str, context: int) -> tuple[tuple[int, ...], tuple[float, ...]] | None:
        """(rows, cost of that many rows in 1-row steps) measured before for batched steps."""
        value = self.entry.get("batch_costs", {}).get(f"{layout}@{context}")
        return None if value is None else (tuple(value["rows"]), tuple(float(c) for c in value["costs"]))

    def store_batch_costs(self, layout: str, context: int, rows: tuple[int, ...], costs: tuple[float, ...]) -> None:
        self.entry.setdefault("batch_costs", {})[f"{layout}@{context}"] = {"rows": list(rows), "costs": list(costs)}
        self._write()

    def attention_seconds(self, layout: str, context: int) -> float | None:
        """Seconds of attention per row and key of a step (all layers), measured before."""
        value = self.entry.get("attention", {}).get(f"{layout}@{context}")
        return None if value is None else float(value)

    def store_attention_seconds(self, layout: str, context: int, seconds: float) -> None:
        self.entry.setdefault("attention", {})[f"{layout}@{context}"] = seconds
        self._write()

    def store_layout(self, layout: str) -> None:
        self.entry["layout"] = layout
        self._write()

    @property
    def prefill(self) -> str | None:
        """The prefill `auto` chose before for this key ("hf" or "engine"), or None."""
        return self.entry.get("prefill")

    def store_prefill(self, prefill: str) -> None:
        self.entry["prefill"] = prefill
        self._write()

    def store_step_costs(self, layout: str, context: int, costs: tuple[float, ...], seconds: float) -> None:
        self.entry.setdefault("step_costs", {})[f"{layout}@{context}"] = {
            "costs": list(costs), "one_row_seconds": seconds}
        self._write()

    def _write(self) -> None:
        """Merge this entry into the file as it is now and replace it atomically, holding the
        writers' lock (another process's entry written meanwhile is kept). A cache that cannot
        be written costs a measurement next time, nothing else: one warning, no error."""
        if not self.enabled:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _writers_lock(self.path):
                entries = read_entries(self.path, [])  # as it is now (its problems were said at reading)
                entries.pop(self.digest, None)
                entries[self.digest] = {"key": self.key, **self.entry}  # newest last
                while len(entries) > MAX_ENTRIES:
                    entries.pop(next(iter(entries)))
                try:
                    text = json.dumps({"format": FORMAT, "entries": entries}, indent=1, allow_nan=False)
                except (ValueError, RecursionError):  # another entry nests too deep to write back
                    text = json.dumps({"format": FORMAT, "entries": {self.digest: entries[self.digest]}},
                                      indent=1, allow_nan=False)
                _replace_atomically(self.path, text)
        except (OSError, ValueError) as err:  # ValueError: a NaN measured, not written
            warnings.warn(f"could not write the hf_selfspec measurement cache {self.path}: {err}",
                          RuntimeWarning, stacklevel=3)


def _short(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: a warning quotes untrusted content."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _replace_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, then rename it over
    `path`: a reader (or a crash) sees the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _writers_lock(path: Path):
    """Hold an exclusive advisory lock on `<path>.lock` while reading, merging and replacing
    the file, so two processes' writes take turns instead of one dropping the other's entry.
    The lock ends with its holder (a killed process holds nothing). Without fcntl (Windows),
    writes are still atomic, only not serialised."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
