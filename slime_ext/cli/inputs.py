"""Where ``slime-ext plan`` gets sample lengths from: a JSONL file, a ``.npy`` file, or a synthetic spec.

Every reader returns :class:`Samples` and raises :class:`CLIError` naming the file, the line and the field.

**JSONL** (``.jsonl``, ``.ndjson``, any other name; ``.gz`` is decompressed): one JSON object per line, blank lines
skipped. Fields:

* ``total_length`` (int >= 1) or ``tokens`` (a list of token ids -> its length, or an int): the sample's tokens;
  when both are given they must agree;
* ``rollout_id`` (int, optional): the rollout the sample belongs to (all samples of a rollout stay in one step);
* ``loss_tokens`` (int, 0 <= loss_tokens <= length, optional): loss-mask tokens, for ``loss_tokens_per_step``.

An optional field is given on every line or on none. Other fields are ignored. Limits (so that token sums stay
inside int64 and nothing is read or allocated without bound): a length is at most ``MAX_TOKENS`` (2**32), a file
holds at most ``MAX_SAMPLES`` (2**27) samples and a line at most :data:`MAX_LINE_BYTES` (64 MiB).

**.npy**: a one-dimensional integer array of lengths (``np.save(path, lengths.astype(np.int64))``); one rollout per
sample.

**Synthetic** (``--synthetic SPEC``)::

    SPEC  := KIND [":" KEY "=" VALUE ("," KEY "=" VALUE)*]
    KIND  := "lognormal" | "pareto"

total length = prompt + response, with

* common keys: ``n`` samples (4096), ``prompt=LO-HI`` uniform integer prompt length, both ends included
  (``100-1500``; a single number is a fixed prompt), ``cap`` response-length cap (16000; ``cap=0`` for none),
  ``seed`` (0), ``samples_per_rollout`` (1: every sample its own rollout; k: rollout ids ``i // k``);
* ``lognormal``: response ~ lognormal(``mu`` = 7.5, ``sigma`` = 1.0), i.e. median ``exp(mu)`` tokens;
* ``pareto``: response ~ ``scale`` x Pareto(``alpha``) (classical Pareto, support [scale, inf); ``alpha`` = 1.2,
  ``scale`` = 300) -- the heavy tail.

Lengths are rounded to integers >= 1. ``loss_tokens`` is the response length (the loss mask covers the response).
The draws match ``bench/workloads.py`` (prompt first, then response, one ``numpy.random.default_rng(seed)``), so
``lognormal:n=1024,seed=1`` is the benchmark's ``rl-1k`` input.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import IO, Callable

import numpy as np

from ..schedule.validate import INT64_MAX, INT64_MIN, MAX_SAMPLES, MAX_TOKENS, limit_name, show
from .errors import CLIError

#: longest JSONL line read (bytes); a longer one (``/dev/zero``, a binary file) is an error, not an endless read
MAX_LINE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Samples:
    """One rollout's samples as the planner takes them."""

    total_lengths: np.ndarray
    rollout_ids: np.ndarray | None
    loss_tokens: np.ndarray | None
    #: where they came from, for the report header (a path or the synthetic spec)
    source: str

    @property
    def num_samples(self) -> int:
        return len(self.total_lengths)

    @property
    def num_rollouts(self) -> int:
        return self.num_samples if self.rollout_ids is None else len(np.unique(self.rollout_ids))


# ---------------------------------------------------------------------------------------------------- progress
#: seconds between progress lines on stderr (the first one after this long too); tests set it to 0
PROGRESS_INTERVAL = float(os.environ.get("SLIME_EXT_PROGRESS_INTERVAL", "1.0"))


class Progress:
    """Throttled progress lines on stderr (``\\r``-updated on a terminal, one line per update otherwise)."""

    def __init__(self, label: str, total: int | None, enabled: bool = True, stream: IO[str] | None = None):
        self.label, self.total, self.enabled = label, total, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.shown = False

    def update(self, done: int, what: Callable[[], str]) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.last < PROGRESS_INTERVAL:
            return
        self.last = now
        pct = f"{100 * done / self.total:5.1f}% " if self.total else ""
        self._write(f"{self.label}: {pct}{what()} ({now - self.start:.1f} s)")

    def finish(self, what: str) -> None:
        if self.enabled and self.shown:
            self._write(f"{self.label}: done, {what} ({time.monotonic() - self.start:.1f} s)", final=True)

    def _write(self, line: str, final: bool = False) -> None:
        self.shown = True
        if self.tty:
            self.stream.write("\r" + line.ljust(79) + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# ---------------------------------------------------------------------------------------------------- JSONL
def _int_field(where: str, name: str, value, minimum: int, maximum: int = MAX_TOKENS) -> int:
    if type(value) is not int:  # bool is an int subclass: reject it too
        raise CLIError(f"{where}: field '{name}' is {json.dumps(value)[:40]}, not an integer; "
                       f"give the token count as a JSON integer")
    if value < minimum:
        raise CLIError(f"{where}: field '{name}' is {show(value)}; it must be >= {minimum}")
    if value > maximum:
        raise CLIError(f"{where}: field '{name}' is {show(value)}, above the limit {limit_name(maximum)} "
                       f"(token sums must stay inside int64)")
    return value


def _sample_length(where: str, obj: dict) -> int:
    total = obj.get("total_length")
    tokens = obj.get("tokens")
    if total is None and tokens is None:
        hint = ""
        if "partitions" in obj and "schema_version" in obj:
            hint = "; this looks like a saved schedule: validate it with `slime-ext plan --from-json FILE`"
        raise CLIError(f"{where}: no 'total_length' or 'tokens' field; every line needs one, "
                       f"e.g. {{\"total_length\": 1234}}{hint}")
    if total is not None:
        total = _int_field(where, "total_length", total, 1)
    if tokens is not None:
        if isinstance(tokens, list):
            if not tokens:
                raise CLIError(f"{where}: field 'tokens' is an empty list; a sample needs at least one token")
            n_tokens = len(tokens)
        else:
            n_tokens = _int_field(where, "tokens", tokens, 1)
        if total is not None and total != n_tokens:
            raise CLIError(f"{where}: field 'total_length' is {total} but 'tokens' counts {n_tokens}; "
                           f"give one of them, or make them agree")
        total = n_tokens
    return total


def _open_binary(path: str) -> tuple[IO[bytes], IO[bytes]]:
    """``(stream to read lines from, raw file whose position measures progress)``."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror}") from None
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw), raw
    return raw, raw


def _lines(stream: IO[bytes], path: str):
    """``(line number, line)``; a line longer than :data:`MAX_LINE_BYTES` (``/dev/zero``) is an error, not a hang."""
    lineno = 0
    while True:
        line = stream.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        lineno += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            raise CLIError(f"{path}:{lineno}: the line is longer than {MAX_LINE_BYTES // 2**20} MiB "
                           f"(MAX_LINE_BYTES); a JSONL file holds one sample per line: is this a text file?")
        yield lineno, line


def _parse_line(where: str, line: bytes):
    try:
        return json.loads(line)
    except UnicodeDecodeError:
        raise CLIError(f"{where}: not UTF-8 text; a JSONL file holds one JSON object per line") from None
    except json.JSONDecodeError as e:
        raise CLIError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); "
                       f"a JSONL file holds one JSON object per line") from None
    except RecursionError:
        raise CLIError(f"{where}: JSON nested too deeply to read; each line is one flat object like "
                       f"{{\"total_length\": 1234}}") from None
    except ValueError as e:  # e.g. an integer literal of more than 4300 digits
        raise CLIError(f"{where}: not readable JSON ({e})") from None


def read_jsonl(path: str, progress: bool = True) -> Samples:
    lengths: list[int] = []
    rids: list[int] = []
    loss: list[int] = []
    has_rid = has_loss = None  # decided by the first sample; every later line must agree
    first_line = 0
    stream, raw = _open_binary(path)
    try:
        size = os.fstat(raw.fileno()).st_size
    except OSError:
        size = 0
    bar = Progress(f"reading {path}", size, enabled=progress)
    with stream, raw:
        lineno = 0
        try:
            for lineno, line in _lines(stream, path):
                if lineno % 4096 == 0:
                    bar.update(raw.tell(), lambda: f"{len(lengths):,} samples")
                line = line.strip()
                if not line:
                    continue
                where = f"{path}:{lineno}"
                if len(lengths) >= MAX_SAMPLES:
                    raise CLIError(f"{where}: more than {limit_name(MAX_SAMPLES)} samples (the most one rollout may "
                                   f"hold, so that token sums stay inside int64); plan the rollout in parts")
                obj = _parse_line(where, line)
                if not isinstance(obj, dict):
                    raise CLIError(f"{where}: a JSON {type(obj).__name__}, not an object; "
                                   f"each line is one sample like {{\"total_length\": 1234, \"rollout_id\": 0}}")
                length = _sample_length(where, obj)
                rid, lt = obj.get("rollout_id"), obj.get("loss_tokens")
                if has_rid is None:
                    has_rid, has_loss, first_line = rid is not None, lt is not None, lineno
                for name, value, expected in (("rollout_id", rid, has_rid), ("loss_tokens", lt, has_loss)):
                    if (value is not None) != expected:
                        raise CLIError(
                            f"{where}: field '{name}' is {'present' if value is not None else 'missing'} but it is "
                            f"{'present' if expected else 'missing'} on line {first_line}; give it on every line "
                            f"or on none"
                        )
                if has_rid:
                    if type(rid) is not int:
                        raise CLIError(f"{where}: field 'rollout_id' is {json.dumps(rid)[:40]}, not an integer")
                    if not INT64_MIN <= rid <= INT64_MAX:
                        raise CLIError(f"{where}: field 'rollout_id' is {show(rid)}, outside int64; give the "
                                       f"rollout's index")
                    rids.append(rid)
                if has_loss:
                    lt = _int_field(where, "loss_tokens", lt, 0)
                    if lt > length:
                        raise CLIError(f"{where}: field 'loss_tokens' is {lt} but the sample has only {length} "
                                       f"tokens; loss tokens are a subset of the sample's tokens")
                    loss.append(lt)
                lengths.append(length)
        except (OSError, EOFError, zlib.error) as e:  # truncated or corrupt .gz, an unreadable device
            raise CLIError(f"{path}:{lineno + 1}: cannot read: {e}"
                           f"{'; is it a complete gzip file?' if path.endswith('.gz') else ''}") from None
    if not lengths:
        raise CLIError(f"{path}: empty file, no samples; it needs one JSON object per line, "
                       f"e.g. {{\"total_length\": 1234}}")
    bar.finish(f"{len(lengths):,} samples")
    return Samples(
        total_lengths=np.asarray(lengths, dtype=np.int64),
        rollout_ids=np.asarray(rids, dtype=np.int64) if has_rid else None,
        loss_tokens=np.asarray(loss, dtype=np.int64) if has_loss else None,
        source=path,
    )


# ---------------------------------------------------------------------------------------------------- .npy
def read_npy(path: str) -> Samples:
    try:  # memory-mapped first: a header that claims more data than the file holds fails here, not in an allocation
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:  # noqa: BLE001 -- numpy's header parser raises several types for a corrupt file
        raise CLIError(f"{path}: not a plain .npy array ({type(e).__name__}: {e}); save integer lengths with "
                       f"np.save(path, lengths.astype(np.int64))") from None
    if not isinstance(arr, np.ndarray):  # np.load of an .npz gives an NpzFile
        raise CLIError(f"{path}: an .npz archive, not an .npy array; save the lengths alone with np.save")
    if arr.ndim != 1:
        raise CLIError(f"{path}: array of shape {arr.shape}; give a one-dimensional array of lengths")
    if arr.dtype.kind not in "iu":
        raise CLIError(f"{path}: array of dtype {arr.dtype}, not integers; save integer lengths with "
                       f"np.save(path, lengths.astype(np.int64))")
    if arr.size == 0:
        raise CLIError(f"{path}: empty array, no samples")
    if arr.size > MAX_SAMPLES:
        raise CLIError(f"{path}: {arr.size:,} lengths, above the limit {limit_name(MAX_SAMPLES)} samples per rollout "
                       f"(token sums must stay inside int64); plan the rollout in parts")
    arr = np.array(arr)  # compared in its own dtype: a uint64 above int64 never wraps
    for bad_entries, rule in ((arr < 1, "every length must be >= 1"),
                              (arr > MAX_TOKENS, f"every length must be <= {limit_name(MAX_TOKENS)}")):
        if bad_entries.any():
            bad = int(np.argmax(bad_entries))
            raise CLIError(f"{path}: entry {bad} is {show(int(arr[bad]))}; {rule}")
    lengths = arr.astype(np.int64)
    return Samples(total_lengths=lengths, rollout_ids=None, loss_tokens=None, source=path)


# ---------------------------------------------------------------------------------------------------- synthetic
_COMMON = {"n": 4096, "prompt": (100, 1500), "cap": 16000, "seed": 0, "samples_per_rollout": 1}
_KINDS = {
    "lognormal": {"mu": 7.5, "sigma": 1.0},
    "pareto": {"alpha": 1.2, "scale": 300.0},
}
SYNTHETIC_HELP = (
    "KIND:key=value,... with KIND lognormal (keys mu=7.5, sigma=1.0) or pareto (alpha=1.2, scale=300: "
    "response = scale x Pareto(alpha)); common keys n=4096, prompt=100-1500 (uniform, inclusive), "
    "cap=16000 (response cap, 0 = none), seed=0, samples_per_rollout=1. "
    "Example: lognormal:n=4096,mu=7.5,sigma=1.0,prompt=100-1500,cap=16000,seed=0"
)


def _parse_spec(spec: str) -> tuple[str, dict]:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in _KINDS:
        raise CLIError(f"--synthetic {spec!r}: unknown distribution {kind!r}; use one of {', '.join(_KINDS)} "
                       f"({SYNTHETIC_HELP})")
    params = {**_COMMON, **_KINDS[kind]}
    given = set()
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            raise CLIError(f"--synthetic {spec!r}: {item!r} is not key=value")
        if key not in params:
            raise CLIError(f"--synthetic {spec!r}: unknown key {key!r} for {kind}; "
                           f"keys are {', '.join(params)}")
        if key in given:
            raise CLIError(f"--synthetic {spec!r}: key {key!r} given twice")
        given.add(key)
        default = params[key]
        try:
            if key == "prompt":
                lo, dash, hi = value.strip().partition("-")
                params[key] = (int(lo), int(hi) if dash else int(lo))
            elif isinstance(default, int):
                params[key] = int(value)
            else:
                params[key] = float(value)
        except ValueError:
            want = "LO-HI integers" if key == "prompt" else type(default).__name__
            raise CLIError(f"--synthetic {spec!r}: {key}={value!r} is not {want}") from None
    return kind, params


#: the largest synthetic seed (numpy takes any non-negative integer; a bound keeps the spec readable)
MAX_SEED = 2**64 - 1


def _check_params(spec: str, kind: str, p: dict) -> None:
    """Every key in range, naming the key; before anything is drawn or allocated."""
    lo, hi = p["prompt"]

    def fail(msg: str) -> None:
        raise CLIError(f"--synthetic {spec!r}: {msg}")

    def bounded(key: str, low: int, high: int, why: str = "") -> None:
        if not low <= p[key] <= high:
            fail(f"{key}={show(p[key])} is outside {low}..{limit_name(high)}{why}")

    bounded("n", 1, MAX_SAMPLES, " (samples; refused before anything is allocated)")
    bounded("seed", 0, MAX_SEED, " (numpy seeds are non-negative)")
    bounded("samples_per_rollout", 1, MAX_SAMPLES)
    bounded("cap", 0, MAX_TOKENS - 1, " (response-length cap; 0 = none)")
    if not 0 <= lo <= hi:
        fail(f"prompt={lo}-{hi} must be 0 <= LO <= HI")
    if hi > MAX_TOKENS - 1:
        fail(f"prompt={lo}-{hi}: HI is above {MAX_TOKENS - 1:,} (a sample is at most {limit_name(MAX_TOKENS)} tokens)")
    for key, value in p.items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{key}={value!r} must be a finite number")
    if kind == "lognormal" and p["sigma"] < 0:
        fail(f"sigma={p['sigma']!r} must be >= 0")
    if kind == "pareto" and not (p["alpha"] > 0 and p["scale"] > 0):
        fail(f"alpha={p['alpha']!r} and scale={p['scale']!r} must both be > 0")


def synthetic(spec: str) -> Samples:
    kind, p = _parse_spec(spec)
    _check_params(spec, kind, p)
    lo, hi = p["prompt"]
    n = p["n"]
    rng = np.random.default_rng(p["seed"])
    prompt = rng.integers(lo, hi, size=n, endpoint=True)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow to inf is caught below, naming the keys
        if kind == "lognormal":
            raw = rng.lognormal(mean=p["mu"], sigma=p["sigma"], size=n)
        else:
            raw = p["scale"] * (1.0 + rng.pareto(p["alpha"], size=n))
        response = np.maximum(1.0, np.rint(raw))
    if p["cap"]:
        response = np.minimum(response, p["cap"])
    longest = float(response.max())
    if not longest <= MAX_TOKENS - hi:  # also NaN
        keys = "mu, sigma" if kind == "lognormal" else "alpha, scale"
        fail_value = f"{longest:.3g}" if math.isfinite(longest) else "infinity"
        raise CLIError(f"--synthetic {spec!r}: the {kind} responses reach {fail_value} tokens, above the limit "
                       f"{limit_name(MAX_TOKENS)} tokens per sample; lower {keys} or set cap=N")
    response = response.astype(np.int64)
    k = p["samples_per_rollout"]
    return Samples(
        total_lengths=(prompt + response).astype(np.int64),
        rollout_ids=None if k == 1 else np.arange(n, dtype=np.int64) // k,
        loss_tokens=response,
        source=f"synthetic {spec}",
    )


def load_samples(path: str | None, spec: str | None, progress: bool = True) -> Samples:
    """The samples from ``path`` (JSONL or ``.npy`` by extension) or from the synthetic ``spec``."""
    if spec is not None:
        return synthetic(spec)
    assert path is not None
    if path.endswith(".npy"):
        return read_npy(path)
    return read_jsonl(path, progress=progress)


# ---------------------------------------------------------------------------------------------------- saved schedule
#: largest schedule file ``--from-json`` reads (about 8 million samples at ~31 bytes each as ``--json`` writes them).
#: Replaying takes about 25x the file's size in memory (the parsed lists, then the arrays and the checker), so this
#: bound also keeps a replay inside a few GiB; a larger rollout is planned again from its lengths, not replayed.
MAX_SCHEDULE_BYTES = 256 * 2**20
#: bytes per read(): read() allocates its whole argument first, so the file is read in chunks of this size
READ_CHUNK_BYTES = 2**20


def _refuse_large(path: str, size: str) -> CLIError:
    return CLIError(f"{path}: {size}, above the {MAX_SCHEDULE_BYTES // 2**20} MiB --from-json reads "
                    f"(MAX_SCHEDULE_BYTES); plan the rollout again from its lengths instead of replaying it")


def _read_bounded(path: str) -> bytes:
    """The file's bytes, refused above :data:`MAX_SCHEDULE_BYTES` by its size before reading, and read in
    :data:`READ_CHUNK_BYTES` chunks so that nothing larger than the file (or the bound) is ever allocated. A pipe or
    device has no size: it is read to the bound and refused past it; one that does not start with ``{`` (``/dev/zero``)
    is refused after its first chunk."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_SCHEDULE_BYTES:
                raise _refuse_large(path, f"{size:,} bytes")
            buf = bytearray()
            while True:
                chunk = f.read(READ_CHUNK_BYTES)
                if not chunk:
                    return bytes(buf)
                if not buf and chunk.lstrip()[:1] not in (b"{", b""):  # /dev/zero, a binary file: refused now
                    raise CLIError(f"{path}: does not start with a JSON object ('{{'); --from-json takes a "
                                   f"schedule written by --json")
                buf += chunk
                if len(buf) > MAX_SCHEDULE_BYTES:  # a pipe, a device, a file that grew since fstat
                    raise _refuse_large(path, "more bytes than that")
    except OSError as e:
        raise CLIError(f"cannot read {path}: {e.strerror or e}") from None


def _is_jsonl(text: str) -> bool:
    """Whether ``text`` reads as JSON Lines: at least two non-empty lines, the first two each a JSON object."""
    lines = [line for line in text.splitlines()[:3] if line.strip()]
    if len(lines) < 2:
        return False
    try:
        return all(isinstance(json.loads(line), dict) for line in lines[:2])
    except (json.JSONDecodeError, RecursionError, ValueError):
        return False


def load_schedule_json(path: str) -> dict:
    """The JSON object in a schedule file written by ``plan --json`` (for ``--from-json``), read with a bound.

    Every failure is a :class:`CLIError` (exit 2: bad input, not an invalid schedule): above
    :data:`MAX_SCHEDULE_BYTES`, not UTF-8, not JSON, not an object, or too large to parse in this process's memory.
    """
    data = _read_bounded(path)
    size = len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CLIError(f"{path}: not UTF-8 text; --from-json takes a schedule written by --json") from None
    del data
    if not text.strip():
        raise CLIError(f"{path}: empty file; --from-json takes a schedule written by --json")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if _is_jsonl(text):
            raise CLIError(f"{path}: JSONL (one JSON object per line, e.g. a rollout's samples), not a schedule; "
                           f"--from-json takes one JSON object written by plan --json; to plan these samples, give "
                           f"the file as INPUT: slime-ext plan {path} ...") from None
        raise CLIError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise CLIError(f"{path}: JSON nested too deeply to read; --from-json takes a schedule written by --json") \
            from None
    except MemoryError:
        raise CLIError(f"{path}: {size:,} bytes of JSON do not fit in this process's memory once parsed (about "
                       f"25x the file); raise the memory limit (ulimit -v) or plan again from the lengths") from None
    except ValueError as e:  # e.g. an integer literal of more than 4300 digits
        raise CLIError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CLIError(f"{path}: a JSON {type(obj).__name__}, not a schedule object; --from-json takes a "
                       f"schedule written by --json")
    return obj
