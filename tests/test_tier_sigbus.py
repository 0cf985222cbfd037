"""A file-backed tier's mapped page that cannot be read (its file truncated by another process,
as a disk I/O error would) is an ``OSError`` naming the file, never a SIGBUS that kills the
process: ``ops.guarded_copy_rows`` (csrc/copy_rows_cpu.cpp) through ``modules/tier_guard.py``.

Each scenario runs in a child process (``subprocess.run([sys.executable, "-c", ...])``): a SIGBUS
there fails the test instead of killing pytest. A truncated file is given its bytes back after
the error (``os.truncate`` to its size, then the bytes cut written again: a truncation alone
would read zeros where the rows were), and the module must then train as the all-resident
oracle of tests/test_tier_faults.py: the failed batch, given again, lands as if given once.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, TESTS, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


def _passes(code: str) -> str:
    done = _run(code)
    assert done.returncode == 0, f"child exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip().endswith("PASSED"), done.stdout
    return done.stdout


# The child's common part: twins trained on the same batches (test_tier_faults' helpers), and a
# file cut to `keep` bytes, then given its bytes back.
_TWINS = """
import os, tempfile
GUARD = os.environ.get("GUARD", "size")
import torch
from test_tier_faults import _check_maps_of, _module, _random_batches, _trains_alike
from torchrec_ext.modules.tier_store import HEADER_BYTES

batches = _random_batches(20, seed=7)
resident, tiered = _module(), _module(f"file:{tempfile.mkdtemp()}")
for kjt in batches[:12]:
    for m in (resident, tiered):
        m(kjt).values().square().sum().backward()
tables = tiered._tables

def cut(path, keep=HEADER_BYTES):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(keep)
        tail = f.read()
    os.truncate(path, keep)
    def restore():
        os.truncate(path, size)
        with open(path, "r+b") as f:
            f.seek(keep)
            f.write(tail)
    return restore

def fails(call, path, said="shorter than" if GUARD == "size" else "byte offset"):
    try:
        call()
    except OSError as e:
        assert e.errno == 5 and repr(path) in str(e) and said in str(e), str(e)
        print("raised:", e)
        return
    raise AssertionError("no OSError")

if GUARD in ("sigbus", "pread"):  # (no check of the files' sizes first: the cut pages' SIGBUS, or the
    from torchrec_ext.modules import tier_guard  # reads by pread ending at the cut, are what raise)
    tier_guard.check_whole = lambda *args, **kwargs: None
    tier_guard.READ_WITH_PREAD = GUARD == "pread"

# rows: every row folded into the rows files (flush), the weights file cut to its header. log:
# every dirty row appended to its log (state_dict: the slots clean, so that no write-back appends,
# extending the file, before a read), table t's log cut.
def cut_one(kind, t):
    if kind == "rows":
        tables.flush()
        path = tables.store.path("weights")
    else:
        tiered.state_dict()
        assert tables.store.logs()[t].live > 0
        path = tables.store.logs()[t].path
    return path, cut(path)
"""


@pytest.mark.parametrize("guard", ["size", "sigbus", "pread"])
@pytest.mark.parametrize("cut_file", ["rows", "log"])
@pytest.mark.parametrize("reader", ["step", "checkpoint"])
def test_a_step_or_checkpoint_reading_a_truncated_file_raises_and_the_module_trains_on_as_the_oracle(
    cut_file, reader, guard, monkeypatch
):
    # step: its misses read past the rows file's end (rows) or a logged row of table a (log);
    # then the failed batch again, landing as if given once. checkpoint: state_dict reads every
    # row (table b's log). size: the file found shorter than its mapping before the copy;
    # sigbus: that check off, reads through the mapping, the cut page's SIGBUS in the guarded
    # copy; pread: that check off, the reads by pread (the default) ending at the cut.
    monkeypatch.setenv("GUARD", guard)
    call, t = ("lambda: tiered(batches[12])", 0) if reader == "step" else ("tiered.state_dict", 1)
    said = "shorter than" if guard == "size" else "byte offset"
    _passes(
        _TWINS
        + f"""
path, restore = cut_one({cut_file!r}, {t})
fails({call}, path, {said!r})
restore()
_check_maps_of(tiered)
_trains_alike(resident, tiered, batches[12:])
print("PASSED")
"""
    )


@pytest.mark.parametrize("cut_file", ["rows", "log"])
def test_a_file_cut_within_a_page_is_refused_before_any_copy_and_the_module_trains_on(cut_file):
    # The cut page stays mapped in part (no SIGBUS: its bytes past the end read as zeros, writes
    # to them are lost): the size check refuses the step (its misses read the rows file, or the
    # log: its reads and its appends) before a row moves.
    _passes(
        _TWINS
        + f"""
if {cut_file!r} == "rows":
    tables.flush()
    path = tables.store.path("weights")
else:
    tiered.state_dict()
    path = tables.store.logs()[0].path
restore = cut(path, keep=HEADER_BYTES + 100)
fails(lambda: tiered(batches[12]), path, "shorter than")
restore()
_check_maps_of(tiered)
_trains_alike(resident, tiered, batches[12:])
print("PASSED")
"""
    )


def test_a_load_failing_after_writing_a_table_leaves_every_table_of_the_load_empty():
    # Tables of 1 MiB each: the weights file cut a page into the second table's rows, so the
    # load writes the first table whole, then fails. Neither is left half loaded (nor the first
    # loaded alone), and the error says so; the file given back, the same load then lands.
    _passes(
        """
import os, tempfile
import torch
from torchrec import KeyedJaggedTensor
from test_tier_faults import _trains_alike
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules.tier_store import HEADER_BYTES, PAGE_BYTES

def module(backing=None):
    tier = {} if backing is None else {"backing": backing, "cache_load_factor": 0.5}
    configs = [
        DynamicEmbeddingBagConfig(name=n, embedding_dim=64, num_embeddings=4096, feature_names=[f], **tier)
        for n, f in (("a", "f0"), ("b", "f1"))
    ]
    return DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})

gen = torch.Generator().manual_seed(0)
def batch():
    ids = torch.cat([torch.randperm(3000, generator=gen)[:200] for _ in range(2)])
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, torch.ones(ids.numel(), dtype=torch.int64))

resident, tiered = module(), module(f"file:{tempfile.mkdtemp()}")
for kjt in [batch() for _ in range(3)]:
    for m in (resident, tiered):
        m(kjt).values().square().sum().backward()
state = resident.state_dict()
tables = tiered._tables
tables.flush()
path = tables.store.path("weights")
start = tables.table_view(0).data_ptr() - HEADER_BYTES  # (the file's mapping: table a's rows first)
second = tables.table_view(1).data_ptr() - start  # where table b's rows start in the file
keep = -(-second // PAGE_BYTES) * PAGE_BYTES + PAGE_BYTES
size = os.path.getsize(path)
with open(path, "rb") as f:
    f.seek(keep)
    tail = f.read()
os.truncate(path, keep)
try:
    tiered.load_state_dict(state)
    raise AssertionError("no OSError")
except OSError as e:
    assert e.errno == 5 and repr(path) in str(e) and "every table it loads is left empty (['a', 'b'])" in str(e), str(e)
assert [tables.indexes[t].size() for t in range(2)] == [0, 0]
os.truncate(path, size)
with open(path, "r+b") as f:
    f.seek(keep)
    f.write(tail)
tiered.load_state_dict(state)
_trains_alike(resident, tiered, [batch() for _ in range(4)])
print("PASSED")
"""
    )


def test_a_load_writing_a_truncated_file_raises_and_a_load_after_it_lands():
    # The load's first table fails (its rows past the file's end): left empty, not with ids
    # reading rows not theirs; the file given back, the same load then lands.
    _passes(
        _TWINS
        + """
state = resident.state_dict()
tables.flush()
path = tables.store.path("weights")
restore = cut(path)
fails(lambda: tiered.load_state_dict(state), path)
assert tables.indexes[0].size() == 0
restore()
tiered.load_state_dict(state)
_trains_alike(resident, tiered, batches[12:])
print("PASSED")
"""
    )


def test_a_log_cleaning_a_truncated_segment_raises_oserror():
    # Cleaning reads a segment's row numbers and live records through the mapping.
    _passes(
        _TWINS
        + """
log = tables.store.logs()[0]
segment = int(log.in_use.nonzero()[0])
restore = cut(log.path)
fails(lambda: log._live_records(segment), log.path)
restore()
_trains_alike(resident, tiered, batches[12:])
print("PASSED")
"""
    )


_SIGBUS_AFTER_A_STEP = """
import os, signal, tempfile
from test_tier_faults import _module, _random_batches
tiered = _module(f"file:{tempfile.mkdtemp()}")
for kjt in _random_batches(3):
    tiered(kjt).values().square().sum().backward()  # (guarded copies ran: the handler is installed)
print("stepped", flush=True)
"""


def test_a_sigbus_outside_a_guarded_copy_still_kills_the_process_by_sigbus():
    done = _run(_SIGBUS_AFTER_A_STEP + "os.kill(os.getpid(), signal.SIGBUS)\nprint('survived')")
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)
    assert "stepped" in done.stdout and "survived" not in done.stdout


def test_a_sigbus_outside_a_guarded_copy_goes_to_faulthandler_installed_before():
    # pytest's faulthandler (as -X faulthandler): it reports the fault, then the default action.
    done = _run(_SIGBUS_AFTER_A_STEP + "os.kill(os.getpid(), signal.SIGBUS)", "-X", "faulthandler")
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)
    assert "Fatal Python error: Bus error" in done.stderr


def test_an_unguarded_read_of_a_truncated_mapping_still_dies_by_sigbus():
    # Only the guarded copies turn a fault into an error: a plain torch read of the mapping
    # (here the table's parameter view) faults as before.
    done = _run(
        _SIGBUS_AFTER_A_STEP
        + """
tables = tiered._tables
tables.flush()
os.truncate(tables.store.path("weights"), 4096)
print(float(tables.table_view(0).sum()))
"""
    )
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)


def test_a_fault_in_a_parallel_copy_raises_and_names_the_offset():
    # Rows on two threads (at::parallel_for: more rows than its grain of 4096, else the copy runs
    # on the calling thread alone): the part that faults ends the copy (the other part may have
    # copied its rows); the offset named is past the file's new end.
    _passes(
        """
import os, tempfile, torch
from torchrec_ext.modules import tier_guard
tier_guard.check_whole = lambda *args, **kwargs: None  # (the SIGBUS path: no size check first)
torch.set_num_threads(2)
path = os.path.join(tempfile.mkdtemp(), "rows")
rows, dim = 2 * 4096, 64
with open(path, "wb") as f:
    f.write(torch.arange(rows * dim, dtype=torch.float32).numpy().tobytes())
whole = torch.from_file(path, shared=True, size=rows * dim, dtype=torch.float32)
tier_guard.register(whole, path, "tables ['t']")
table = whole.view(rows, dim)
keep = rows * dim * 4 // 2
os.truncate(path, keep)
first = torch.empty(10, dim)
tier_guard.copy_rows(first, None, table, torch.arange(10), "read")
assert torch.equal(first, torch.arange(640.0).view(10, 64))
for index, write in ((torch.arange(rows), False), (torch.arange(rows).flip(0), True)):
    try:
        if write:
            tier_guard.copy_rows(table, index, torch.zeros(rows, dim), None, "write")
        else:
            tier_guard.copy_rows(torch.empty(rows, dim), None, table, index, "read")
    except OSError as e:
        offset = int(str(e).split("byte offset ")[1].split(":")[0])
        assert keep <= offset < rows * dim * 4 and repr(path) in str(e), str(e)
    else:
        raise AssertionError("no OSError")
print("PASSED")
"""
    )


def test_a_fault_outside_a_guarded_copy_kills_by_sigbus_even_when_sigbus_was_ignored():
    # SIG_IGN does not hold for a fault's SIGBUS (the kernel resets it to the default action):
    # the chained handler must not return into the faulting instruction again (a loop for good).
    code = """
import os, signal, tempfile, torch
from torchrec_ext import _C
signal.signal(signal.SIGBUS, signal.SIG_IGN)
_C.install_sigbus_guard()
path = os.path.join(tempfile.mkdtemp(), "rows")
with open(path, "wb") as f:
    f.truncate(1 << 16)
rows = torch.from_file(path, shared=True, size=1 << 14, dtype=torch.float32)
os.truncate(path, 0)
print(float(rows[100]))
print("survived")
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, TESTS, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=30
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("the child hung: its fault's SIGBUS went back to the ignored action") from None
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)
    assert "survived" not in done.stdout
