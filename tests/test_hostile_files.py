"""Hostile checkpoint files: each is refused with one line naming the file,
before any tensor is read, and never hangs, allocates without bound, runs
pickled code or ends in an internal error."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import pickletools
import socket
import struct
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from safetensors import SafetensorError, safe_open

from zeroscan.checkpoint import safetensors_file as safetensors_io, torch_file as torch_io
from zeroscan.checkpoint import CheckpointError, open_checkpoint, scan_checkpoint
from zeroscan.cli import main
from zeroscan.checkpoint.safetensors_file import package_reason


def assert_refused(capsys: pytest.CaptureFixture[str], path: Path, *words: str) -> str:
    """Both the Python API and the CLI refuse `path` with one line naming it and
    holding every one of `words`; returns that line."""
    with pytest.raises(CheckpointError) as refused:
        scan_checkpoint(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    for word in words:
        assert word in message, (word, message)
    capsys.readouterr()
    assert main(["scan", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"zeroscan: error: {message}\n", err
    return message


# --- item 3: anything but a regular file is refused before it is opened ---------------------


@contextlib.contextmanager
def unblocked_after(fifo: Path, seconds: float = 60.0) -> Iterator[None]:
    """Guards a test against a regression that opens `fifo` for reading (open()
    would wait for a writer forever): after `seconds`, a writer opens and closes
    it, so the reader sees an empty file and the test fails instead of hanging."""

    def open_as_writer() -> None:
        with contextlib.suppress(OSError):  # no reader waiting: nothing to release
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    timer = threading.Timer(seconds, open_as_writer)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def make_special(kind: str, tmp_path: Path, stack: contextlib.ExitStack) -> Path:
    if kind == "fifo":
        path = tmp_path / "ckpt.pt"
        os.mkfifo(path)
        stack.enter_context(unblocked_after(path))
        return path
    if kind == "socket":
        path = tmp_path / "ckpt.sock"
        if len(str(path)) >= 100:  # sun_path holds about 108 bytes
            pytest.skip("tmp_path too long for a unix socket")
        server = stack.enter_context(socket.socket(socket.AF_UNIX))
        server.bind(str(path))
        return path
    path = Path(kind)
    if not path.exists():
        pytest.skip(f"{kind} is missing here")
    return path


@pytest.mark.parametrize(
    "kind, what",
    [("fifo", "is a FIFO (named pipe)"), ("socket", "is a socket"),
     ("/dev/zero", "is a character device"), ("/dev/null", "is a character device")],
)
def test_special_files_are_refused_without_opening_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str, what: str
) -> None:
    with contextlib.ExitStack() as stack:
        path = make_special(kind, tmp_path, stack)
        assert_refused(capsys, path, what, "not a regular file")


def test_a_fifo_does_not_hang_the_command(tmp_path: Path) -> None:
    """The whole CLI path (its progress bar stats the file first) in a process
    of its own, with a timeout, so a regression fails rather than hangs."""
    fifo = tmp_path / "ckpt.safetensors"
    os.mkfifo(fifo)
    proc = subprocess.run([sys.executable, "-m", "zeroscan", "scan", str(fifo), "--progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"zeroscan: error: {fifo}: is a FIFO (named pipe), not a regular file; " \
                          "zeroscan reads checkpoint files only\n"


# --- items 7 and 10: hostile safetensors headers --------------------------------------------


def safetensors_bytes(header: str | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def one(dtype: str = '"F32"', shape: str = "[1]", offsets: str = "[0,4]") -> str:
    return f'{{"dtype":{dtype},"shape":{shape},"data_offsets":{offsets}}}'


NAN, ONE = struct.pack("<f", float("nan")), struct.pack("<f", 1.0)
F64 = json.dumps("F64")
NOT_JSON, NOT_A_HEADER = "the header is not valid JSON", "the header's JSON is not a safetensors header"
OFFSETS = "does not start where the one before it ends"
NOT_COVERED = "the tensors do not end where the file ends (the file is truncated, or holds bytes outside its tensors)"

# label: (file bytes, words the refusal must hold, whether the safetensors package refuses it; where it
# does not, the refusal is zeroscan's own)
HOSTILE_HEADERS: dict[str, tuple[bytes, tuple[str, ...], bool]] = {
    "a NaN tensor hiding behind a healthy twin": (
        safetensors_bytes(f'{{"w":{one()},"w":{one(offsets="[4,8]")}}}', NAN + ONE), (f"tensor 'w' {OFFSETS}",), True),
    "a name given twice, its bytes read two ways": (  # the package keeps the last: one F64
        safetensors_bytes(f'{{"w":{one(shape="[2]", offsets="[0,8]")},"w":{one(dtype=F64, offsets="[0,8]")}}}',
                          NAN + ONE), ("the key 'w' appears twice in one JSON object",), False),
    "a field given twice": (
        safetensors_bytes('{"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', ONE),
        ("the key 'dtype' appears twice in one JSON object",), True),
    "a metadata key given twice": (
        safetensors_bytes(f'{{"__metadata__":{{"a":"1","a":"2"}},"w":{one()}}}', ONE), ("'a' appears twice",), False),
    "a dim of 2**70": (
        safetensors_bytes(f'{{"w":{one(shape=f"[{2**70}]")}}}', ONE), (NOT_A_HEADER, "expected a non-negative integer"),
        True),
    "dims whose product overflows before a zero": (
        safetensors_bytes(f'{{"w":{one(shape=f"[{2**40},{2**40},0]", offsets="[0,0]")}}}'),
        ("more elements than a tensor can hold",), True),
    "true as a dim": (
        safetensors_bytes(f'{{"w":{one(shape="[true]")}}}', ONE), ("invalid type: boolean true, expected a non-neg",),
        True),
    "false as a dim": (
        safetensors_bytes(f'{{"w":{one(shape="[false]", offsets="[0,0]")}}}'), ("invalid type: boolean false",), True),
    "a float dim": (safetensors_bytes(f'{{"w":{one(shape="[1.0]")}}}', ONE), ("invalid type: floating point 1.0",), True),
    "JSON nested 100k deep": (
        safetensors_bytes('{"__metadata__":' + "[" * 100_000 + "]" * 100_000 + "}"),
        (NOT_A_HEADER, "invalid type: array, expected an object"), True),
    "JSON nested 100k deep where the package reads nothing": (
        safetensors_bytes('{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":' + "[" * 100_000 + "]" * 100_000
                          + "}}", ONE), ("nested deeper than the safetensors package reads",), True),
    "a 5000-digit integer": (
        safetensors_bytes(f'{{"w":{one(shape="[" + "9" * 5000 + "]")}}}', ONE), ("number out of range",), True),
    "a negative offset": (
        safetensors_bytes(f'{{"w":{one(offsets="[-4,0]")}}}', ONE), ("invalid value: integer -4, expected a non-neg",),
        True),
    "false as an offset": (
        safetensors_bytes(f'{{"w":{one(offsets="[false,4]")}}}', ONE), ("invalid type: boolean false",), True),
    "three offsets": (
        safetensors_bytes(f'{{"w":{one(offsets="[0,4,4]")}}}', ONE), ("invalid length 3, expected 2 elements",), True),
    "a torch dtype name": (
        safetensors_bytes(f'{{"w":{one(dtype=json.dumps("float32"))}}}', ONE),
        ("dtype 'float32' is not a safetensors dtype name (did you mean 'F32'?)",), True),
    "an fp16 spelling": (
        safetensors_bytes(f'{{"w":{one(dtype=json.dumps("fp16"), shape="[2]")}}}', ONE), ("did you mean 'F16'?",), True),
    "a complex128 tensor, which zeroscan once wrote": (
        safetensors_bytes(f'{{"c":{one(dtype=json.dumps("C128"), offsets="[0,16]")}}}', ONE * 4),
        ("dtype 'C128' is not a safetensors dtype name",), True),
    "an unknown dtype name": (
        safetensors_bytes(f'{{"w":{one(dtype=json.dumps("Q7"))}}}', ONE), ("(the names are BOOL, F4",), True),
    "a header that is not JSON": (safetensors_bytes("{w: F32}", ONE), (NOT_JSON, "line 1 column 2"), True),
    "a header that is a JSON array": (safetensors_bytes("[1, 2]", ONE), ("the header is a JSON array, not an",), True),
    "a header that is not UTF-8": (
        safetensors_bytes(b'{"w\xff":' + one().encode() + b"}", ONE), ("the header is not UTF-8 text",), True),
    "a lone surrogate in a name": (
        safetensors_bytes(f'{{"\\ud800":{one()}}}', ONE), (NOT_JSON, "hex escape"), True),
    "a file shorter than the header length": (b"\x10\0\0\0", (), True),
    "a header length of 2**63": (
        safetensors_bytes(f'{{"w":{one()}}}', ONE, length=2**63),
        ("header length 9223372036854775808 is more than the 100,000,000 bytes",), True),
    "a header length past the end of the file": (
        safetensors_bytes(f'{{"w":{one()}}}', ONE, length=100), ("header length 100 does not fit a 66-byte file",), True),
    "two tensors on the same bytes": (  # b longer than a: with equal offsets, the package names either, at random
        safetensors_bytes(f'{{"a":{one()},"b":{one(shape="[2]", offsets="[0,8]")}}}', ONE * 2),
        (f"tensor 'b' {OFFSETS}",), True),
    "a tensor inside another": (
        safetensors_bytes(f'{{"a":{one(shape="[2]", offsets="[0,8]")},"b":{one(offsets="[4,8]")}}}', ONE + ONE),
        (f"tensor 'b' {OFFSETS}",), True),
    "a gap between tensors": (
        safetensors_bytes(f'{{"a":{one()},"b":{one(offsets="[8,12]")}}}', ONE * 3), (f"tensor 'b' {OFFSETS}",), True),
    "offsets that run backwards": (
        safetensors_bytes(f'{{"w":{one(offsets="[4,0]")}}}', ONE), (f"tensor 'w' {OFFSETS}",), True),
    "bytes after the last tensor": (safetensors_bytes(f'{{"a":{one()}}}', ONE * 3), (NOT_COVERED,), True),
    "a truncated file": (safetensors_bytes(f'{{"a":{one(shape="[2]", offsets="[0,8]")}}}', ONE), (NOT_COVERED,), True),
    "a byte range the wrong size for its dtype": (
        safetensors_bytes(f'{{"a":{one(dtype=F64)}}}', ONE),
        ("a tensor's data_offsets span a different number of bytes than its shape needs in its dtype",), True),
    "a zero dim before dims whose strides overflow": (
        safetensors_bytes(f'{{"w":{one(shape=f"[0,{2**62},4]", offsets="[0,0]")}}}'),
        (f"tensor 'w' has the shape [0, {2**62}, 4], whose strides or byte size overflow 64 bits",), False),
    "a zero dim between dims whose strides overflow": (
        safetensors_bytes(f'{{"w":{one(shape=f"[{2**31},0,{2**31},{2**31}]", offsets="[0,0]")}}}'),
        ("tensor 'w' has the shape", "whose strides or byte size overflow 64 bits"), False),
    "byte strides that overflow": (  # 2**61 elements apart fit int64; 2**64 bytes apart do not
        safetensors_bytes(f'{{"w":{one(dtype=F64, shape=f"[0,{2**60},2]", offsets="[0,0]")}}}'),
        ("whose strides or byte size overflow 64 bits",), False),
    "2000 dims": (
        safetensors_bytes(f'{{"w":{one(shape=str([1] * 2000))}}}', ONE),
        ("tensor 'w' has 2,000 dimensions, more than the 1,024",), False),
    "a 4-bit tensor that ends mid-byte": (
        safetensors_bytes(f'{{"a":{one(dtype=json.dumps("F4"), shape="[3]", offsets="[0,2]")}}}', ONE[:2]),
        ("a tensor of a 4- or 6-bit dtype does not end on a byte boundary",), True),
}


@pytest.mark.parametrize("label", list(HOSTILE_HEADERS))
def test_hostile_safetensors_headers_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, label: str) -> None:
    data, words, _ = HOSTILE_HEADERS[label]
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(data)
    assert_refused(capsys, path, "corrupt safetensors file: ", *words)


@pytest.mark.parametrize("label", list(HOSTILE_HEADERS))
def test_the_package_makes_every_refusal_but_zeroscans_own(tmp_path: Path, label: str) -> None:
    """The refusals zeroscan makes itself are exactly those the package lets
    through: should the package start refusing one, zeroscan's check can go."""
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(HOSTILE_HEADERS[label][0])
    try:
        with safe_open(path, "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    except SafetensorError:
        refused = True
    else:
        refused = False
    assert refused == HOSTILE_HEADERS[label][2]


# What the package said before 0.6 (its error names), and how zeroscan words each.
OLDER_PACKAGE_MESSAGES = {
    'InvalidOffset("b")': f"tensor 'b' {OFFSETS}",
    "MetadataIncompleteBuffer": NOT_COVERED,
    "HeaderTooLarge": "header length 16 is more than the 100,000,000 bytes",
    "HeaderTooSmall": "the file is 28 bytes, too short",
    "InvalidHeaderLength": "header length 16 does not fit a 28-byte file",
    "TensorInvalidInfo": "data_offsets span a different number of bytes",
    "InvalidHeaderDeserialization": "the header is not valid safetensors JSON",
    "InvalidHeader": "the header is not UTF-8 text",
    "ValidationOverflow": "more elements than a tensor can hold",
    "SomethingNew": "the safetensors package refuses it (SomethingNew)",
}


@pytest.mark.parametrize("message", list(OLDER_PACKAGE_MESSAGES))
def test_older_package_messages_are_worded_too(tmp_path: Path, message: str) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(safetensors_bytes("{}" + " " * 14, b"\0" * 4))
    assert OLDER_PACKAGE_MESSAGES[message] in package_reason(path, f"Error while deserializing header: {message}")


def test_legal_layouts_still_read(tmp_path: Path) -> None:
    """Zero-size tensors may share an offset, a 4-bit dtype is sized in bits, and
    a dtype this torch cannot hold is listed (and skipped by a scan), not refused."""
    header = (f'{{"e1":{one(shape="[0]", offsets="[0,0]")},"e2":{one(shape="[0]", offsets="[0,0]")},'
              f'"w":{one()},"packed":{one(dtype=json.dumps("F4"), shape="[2,3]", offsets="[4,7]")}}}')
    path = tmp_path / "legal.safetensors"
    path.write_bytes(safetensors_bytes(header, ONE + b"\0" * 3))
    with open_checkpoint(path) as c:
        assert c.names() == ["e1", "e2", "w", "packed"] and c.entry("packed").dtype == "F4"
        assert c.tensor("w").tolist() == [1.0] and c.tensor("e2").shape == (0,)
        with pytest.raises(CheckpointError) as refused:
            c.tensor("packed")
        assert str(refused.value) == f"{path}: tensor 'packed' has dtype F4, which has no torch equivalent here"
    result = scan_checkpoint(path)
    assert [r["name"] for r in result.rows] == ["e1", "e2", "w"]
    assert [s["name"] for s in result.skipped] == ["packed"]


@pytest.mark.parametrize("shape", [[2**62, 0], [0] * 70, [2**31, 2**31, 0], [1] * 1024],
                         ids=["2**62 by 0", "70 zero dims", "2**31 by 2**31 by 0", "1024 dims of 1"])
def test_empty_tensors_whose_shapes_fit_are_scanned(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                    shape: list[int]) -> None:
    """Strides that fit int64 (torch counts a zero dim as 1), more dims than
    the native scan takes (flattened), and a rank at the limit: the tensor is
    scanned like any other, and the one beside it too."""
    numel = 1 if 0 not in shape else 0
    path = tmp_path / "edge.safetensors"
    path.write_bytes(safetensors_bytes(f'{{"e":{one(shape=str(shape), offsets=f"[0,{4 * numel}]")},'
                                       f'"w":{one(offsets=f"[{4 * numel},{4 * numel + 4}]")}}}', ONE * (numel + 1)))
    rows = {r["name"]: r for r in scan_checkpoint(path).rows}
    assert rows["e"]["shape"] == shape and rows["e"]["numel"] == numel and rows["w"]["max_abs"] == 1.0
    capsys.readouterr()
    assert main(["scan", str(path), "--fail-on", "none"]) == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("change, what", [
    (lambda h: h["w"].update(shape=[2]), "tensor 'w'"),
    (lambda h: h.update(v=h.pop("w")), "tensor 'w'"),
    (lambda h: h.update(__metadata__={"a": "b"}), "__metadata__"),
], ids=["shape", "name", "metadata"])
def test_a_header_read_otherwise_than_the_package_reads_it_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, change: Callable[[dict], None], what: str
) -> None:
    """Scans read the byte ranges of zeroscan's own reading of the header: it
    must describe the tensors the package validated."""
    loads = json.loads

    def misread(text: str, **kwargs: object) -> object:
        header = loads(text, **kwargs)
        change(header)
        return header

    path = tmp_path / "m.safetensors"
    path.write_bytes(safetensors_bytes(f'{{"w":{one()}}}', ONE))
    monkeypatch.setattr(safetensors_io.json, "loads", misread)
    with pytest.raises(CheckpointError) as refused:
        open_checkpoint(path)
    assert str(refused.value) == (f"{path}: corrupt safetensors file: the safetensors package and zeroscan read "
                                  f"its header differently ({what})")


def test_a_file_replaced_before_its_first_tensor_is_refused(tmp_path: Path) -> None:
    """tensor() maps the file by path when first asked: a file replaced since
    the header was read is refused, not read as the tensors it listed."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(safetensors_bytes(f'{{"w":{one()}}}', ONE))
    with open_checkpoint(path) as c:
        path.unlink()
        path.write_bytes(safetensors_bytes(f'{{"w":{one()}}}', NAN))
        with pytest.raises(CheckpointError) as refused:
            c.tensor("w")
    assert str(refused.value) == f"{path}: changed since it was opened; open it again once it is written"


# --- item 11: containers nested without bound, or containing themselves ---------------------


def torch_file_with_pickle(path: Path, make_pickle: Callable[[bytes], bytes]) -> None:
    """A torch.save zip file whose data.pkl is make_pickle(body), where body is the
    pickle opcodes (no PROTO, no STOP) that rebuild the saved tensor torch.ones(2)."""
    torch.save(torch.ones(2), path)
    with zipfile.ZipFile(path) as z:
        entries = [(info.filename, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries:
            if name.endswith("/data.pkl"):
                assert data[:2] == b"\x80\x02" and data[-1:] == b"."
                data = make_pickle(data[2:-1])
            z.writestr(name, data)


def nested_lists(depth: int) -> Callable[[bytes], bytes]:
    """[[[...[tensor]...]]] `depth` lists deep, built by opcodes: torch.save cannot
    write it (its pickler recurses), but torch.load reads any depth."""
    return lambda body: b"\x80\x02" + b"]" * depth + body + b"a" * depth + b"."


def test_deep_nesting_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "deep.pt"
    torch_file_with_pickle(path, nested_lists(100_000))
    message = assert_refused(capsys, path, "containers nested more than 1000 deep (stopped at 0.0.0.0")
    assert len(message) < 300


def test_nesting_torch_save_can_write_keeps_its_name(tmp_path: Path) -> None:
    path = tmp_path / "fine.pt"
    torch_file_with_pickle(path, nested_lists(999))  # 999 lists, and the tensor in the innermost
    with open_checkpoint(path) as c:
        assert c.names() == [".".join(["0"] * 999)]


def self_containing(zipped: bool) -> Callable[[Path], None]:
    def save(path: Path) -> None:
        d: dict[str, object] = {"w": torch.ones(2), "inner": {"list": [torch.zeros(1)]}}
        d["inner"]["list"].append(d["inner"])  # type: ignore[index]
        torch.save(d, path, _use_new_zipfile_serialization=zipped)

    return save


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_container_that_contains_itself_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, zipped: bool
) -> None:
    path = tmp_path / "cycle.pt"
    self_containing(zipped)(path)
    assert_refused(capsys, path, "the container at inner.list.1 is the one at inner again")


def test_a_dict_that_is_its_own_value(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d: dict[str, object] = {"w": torch.ones(2)}
    d["self"] = d
    path = tmp_path / "self.pt"
    torch.save(d, path)
    assert_refused(capsys, path, "the container at self is the top-level object again")


def test_shared_containers_that_explode_are_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each list holds the one before twice: 2**depth paths in a file of a few hundred
    bytes. (The cap is lowered here so that a regression stays quick.)"""
    monkeypatch.setattr(torch_io, "MAX_REWALKED_ITEMS", 1000)
    level: list[object] = [torch.ones(1)]
    for _ in range(12):
        level = [level, level]
    path = tmp_path / "dag.pt"
    torch.save(level, path)
    assert_refused(capsys, path, "shared containers expand to more than 1,000 items")


def test_flattened_names_are_unchanged(tmp_path: Path) -> None:
    """Depth first in container order, dotted names ("x.z.1.1." for the key ""),
    '#n' for a clash, a shared container under each of its names, non-tensor
    leaves left out: as before flatten became iterative."""
    a, b, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    shared = {"w": a}
    obj = {"model": shared, "ema": shared, "x.y": b, "x": {"y": c, "z": (a, [b, {"": c}])}, "epoch": 3,
           "x.y#2": a, 1: [c, "text"], "": {"": b}}
    path = tmp_path / "names.pt"
    torch.save(obj, path)
    with open_checkpoint(path) as ck:
        assert ck.names() == ["model.w", "ema.w", "x.y", "x.y#2", "x.z.0", "x.z.1.0", "x.z.1.1.", "x.y#2#2", "1.0",
                              "tensor"]


# --- item 13: a pickle that would run code ---------------------------------------------------


class Payload:
    """Pickles as a call of `func(*args)`: what a hostile checkpoint holds."""

    def __init__(self, func: Callable[..., object], *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, ...]:
        return self.func, self.args


def payloads(marker: Path) -> dict[str, Payload]:
    return {
        "os.system": Payload(os.system, f"touch {marker}"),
        "builtins.eval": Payload(builtins.eval, f"open({str(marker)!r}, 'w').close()"),
        "builtins.exec": Payload(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
        "subprocess.call": Payload(subprocess.call, ["touch", str(marker)]),
    }


# The GLOBAL each payload's pickle holds (protocol 2 writes Python 2's module
# names: __builtin__, commands), and the words of the refusal.
REFUSALS = {
    "os.system": (f"{os.system.__module__} system", f"asks for {os.system.__module__}.system, from module "
                  f"{os.system.__module__}, which torch's weights_only loader blocks"),
    "builtins.eval": ("__builtin__ eval", "asks for builtins.eval, a builtin"),
    "builtins.exec": ("__builtin__ exec", "asks for builtins.exec, a builtin"),
    "subprocess.call": ("commands call", "holds a commands.call object"),
}


def globals_in(path: Path) -> set[str]:
    """The GLOBAL opcodes of a torch.save file's object pickle, read without running it."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            data = z.read(next(name for name in z.namelist() if name.endswith("/data.pkl")))
    else:  # the legacy format: pickles one after another; the object is the fourth
        data = path.read_bytes()
    found: set[str] = set()
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        try:
            found |= {str(arg) for op, arg, _ in pickletools.genops(stream) if op.name == "GLOBAL"}
        except ValueError:  # the legacy format's raw storage bytes after its pickles
            break
    return found


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("payload", list(REFUSALS))
def test_a_pickle_that_would_run_code_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, payload: str, zipped: bool
) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "hostile.pt"
    torch.save({"w": torch.ones(2), "x": payloads(marker)[payload]}, path, _use_new_zipfile_serialization=zipped)
    global_name, words = REFUSALS[payload]
    assert global_name in globals_in(path)  # the call is really there to refuse
    message = assert_refused(capsys, path, words, "so nothing in the file ran")
    assert "False" not in message  # never torch's advice to retry with weights_only=False
    assert not marker.exists()


def test_a_pickle_torch_cannot_read_is_named_without_torchs_advice(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "protocol4.pt"
    torch.save({"w": torch.ones(2), "x": payloads(marker)["os.system"]}, path, pickle_protocol=4)
    message = assert_refused(capsys, path, "the pickle uses opcode FRAME (pickle protocol 4)")
    assert "weights_only=False" not in message and "False" not in message
    assert not marker.exists()


# --- item 20: a zip entry that inflates -----------------------------------------------------


def zip_bomb(path: Path) -> None:
    """A torch.save file whose data.pkl is deflated and inflates to 64 MiB (a valid
    pickle, then zeros that torch.load would read whole): about 70 kB on disk."""
    torch.save({"w": torch.ones(2)}, path)
    with zipfile.ZipFile(path) as z:
        entries = [(info.filename, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries:
            if not name.endswith("/data.pkl"):
                z.writestr(name, data)
                continue
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            with z.open(info, "w") as f:
                f.write(data)
                for _ in range(64):
                    f.write(bytes(1 << 20))


def oversized_entry(path: Path) -> None:
    """A stored data.pkl whose directory record claims 2 GiB."""
    torch.save({"w": torch.ones(2)}, path)
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    record = raw.index(b"PK\x01\x02")  # the directory's first record: torch writes data.pkl first
    assert raw[record + 46:record + 46 + len(info.filename)] == info.filename.encode()
    raw[record + 20:record + 28] = struct.pack("<II", 2**31, 2**31)  # compressed and uncompressed sizes
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "build, words",
    [(zip_bomb, ("/data.pkl' is compressed (deflate", "inflate to 67,")),
     (oversized_entry, ("/data.pkl' declares 2,147,483,648 bytes, which do not fit",))],
    ids=["deflated", "oversized"],
)
def test_zip_entries_are_checked_before_loading(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    build: Callable[[Path], None], words: tuple[str, ...]
) -> None:
    path = tmp_path / "bomb.pt"
    build(path)
    assert path.stat().st_size < 1 << 20
    loads: list[object] = []
    monkeypatch.setattr(torch_io.torch, "load", lambda *args, **kwargs: loads.append(args))
    assert_refused(capsys, path, *words)
    assert loads == []  # refused before torch.load saw the file


# --- issue 43, item 11: a folder holding entries named like checkpoints that are no regular files ---
# Each such entry alone is refused (above); in a folder beside valid checkpoints it was passed over in
# silence and the rest scanned with exit 0. The folder is now refused, naming every such entry.
# The issue named a FIFO, a socket and a link to /dev/zero; the unnamed members tested here are a link
# to nothing, a FIFO named like a shard index, and such an entry in a sub-folder.


def plant_entry(folder: Path, name: str, kind: str, stack: contextlib.ExitStack,
                monkeypatch: pytest.MonkeyPatch) -> str:
    """Makes folder/name an entry of `kind`; returns how the refusal describes it."""
    path = folder / name
    if kind == "fifo":
        os.mkfifo(path)
        stack.enter_context(unblocked_after(path))  # a regression that opens it fails, not hangs
        return f"{name} (a FIFO (named pipe))"
    if kind == "socket":
        monkeypatch.chdir(folder)  # bound by its relative name: sun_path holds about 108 bytes
        server = stack.enter_context(socket.socket(socket.AF_UNIX))
        server.bind(name)
        return f"{name} (a socket)"
    if kind == "link to /dev/zero":
        if not Path("/dev/zero").exists():
            pytest.skip("/dev/zero is missing here")
        path.symlink_to("/dev/zero")
        return f"{name} (a link to a character device)"
    assert kind == "link to nothing"
    path.symlink_to(folder / "gone.pt")
    return f"{name} (a link to nothing)"


FOLDER_ENTRIES = {
    "named": {"b.safetensors": "fifo", "c.pt": "socket", "d.bin": "link to /dev/zero"},
    "unnamed": {"e.ckpt": "link to nothing", "model.safetensors.index.json": "fifo"},
}


@pytest.mark.parametrize("nested", [False, True], ids=["in the folder", "in a sub-folder"])
@pytest.mark.parametrize("members", FOLDER_ENTRIES)
def test_a_folder_names_each_entry_it_cannot_read(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, members: str,
    nested: bool
) -> None:
    folder = tmp_path / "ckpts"
    holder = folder / "sub" if nested else folder
    holder.mkdir(parents=True)
    torch.save({"w": torch.ones(3)}, folder / "a.pt")  # a valid checkpoint beside them
    with contextlib.ExitStack() as stack:
        described = [plant_entry(holder, name, kind, stack, monkeypatch)
                     for name, kind in sorted(FOLDER_ENTRIES[members].items())]
        verb = "is named like a checkpoint but is not a regular file" if len(described) == 1 else \
            "are named like checkpoints but are not regular files"
        want = f"{holder}: {', '.join(described)} {verb}; zeroscan reads checkpoint files only, " \
               "and scans a folder whole or not at all"
        for call in (scan_checkpoint, open_checkpoint):
            with pytest.raises(CheckpointError) as refused:
                call(folder)
            assert str(refused.value) == want
        capsys.readouterr()
        assert main(["scan", str(folder)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == f"zeroscan: error: {want}\n", err
        # Without them the folder scans as before: the refusal is theirs.
        for name in FOLDER_ENTRIES[members]:
            (holder / name).unlink()
        assert main(["scan", str(folder)]) == 0
