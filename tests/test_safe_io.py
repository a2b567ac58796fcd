"""Untrusted files cannot run code or write elsewhere (issue 16).

* A CIFAR archive (tarball or extracted folder) whose pickle would run code is
  refused by the restricted unpickler, naming the file or member and the
  global; the payload never runs. Pickles written by numpy 1 or 2, at any
  protocol, still load.
* Archives with absolute or ``..`` member names, links or devices are refused.
* ``--download`` keeps the archive only if its md5 is the published one; a
  failed or corrupt download leaves nothing behind.
* A runner checkpoint whose pickle would run code is refused on ``--resume``
  (``torch.load(weights_only=True)``), naming the file and the global; the
  runner writes checkpoints of plain values only, and reads older ones whose
  numpy random state is an array.

Each malicious payload is first shown to be live: unpickled the ordinary way,
it creates its marker file.
"""
from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle
import random
import re
import tarfile
import warnings

import numpy as np
import pytest
import torch
from torch_versions import needs

from whitenlayers.experiment import _safe_io, data
from whitenlayers import experiment as ex
from whitenlayers.experiment._safe_io import UnsafeFileError
from whitenlayers.experiment.data import load_dataset


class Touch:
    """Unpickling this calls ``pathlib.Path.touch(marker)``."""

    def __init__(self, marker):
        self.marker = pathlib.Path(marker)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


class System:
    """Unpickling this calls ``os.system("touch marker")``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


PAYLOADS = {"pathlib.touch": Touch, "os.system": System}

CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def _batch(n=10, seed=0):
    rng = np.random.default_rng(seed)
    return {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"batch_label": b"training batch", b"filenames": [b"x.png"] * n}


def _write_archive(path, members, folder="cifar-10-batches-py"):
    """``members``: name -> raw bytes (regular files under ``folder``) or a ready ``TarInfo`` (no data)."""
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(_dir_info(folder))
        for name, raw in members.items():
            if isinstance(raw, tarfile.TarInfo):
                tar.addfile(raw)
                continue
            info = tarfile.TarInfo(name if "/" in name else f"{folder}/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return str(path)


def _dir_info(name):
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    return info


def _good_members():
    return {f: pickle.dumps(_batch(seed=i), protocol=2) for i, f in enumerate(CIFAR10_FILES)}


# --------------------------------------------------------------------------
# CIFAR archives
# --------------------------------------------------------------------------
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("layout", ["tarball", "folder"])
def test_malicious_cifar_batch_is_refused_and_runs_nothing(tmp_path, payload, layout):
    marker = tmp_path / "MARKER"
    evil = {**_batch(), b"labels": [PAYLOADS[payload](marker)]}
    raw = pickle.dumps(evil, protocol=2)
    # the payload is live: an ordinary unpickler runs it
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(PAYLOADS[payload](live), protocol=2))
    assert live.exists()

    members = _good_members()
    members["data_batch_3"] = raw
    archive = _write_archive(tmp_path / "cifar-10-python.tar.gz", members)
    if layout == "tarball":
        source, where = archive, f"{archive}: member cifar-10-batches-py/data_batch_3"
    else:
        source = str(tmp_path / "extracted")
        with tarfile.open(archive) as tar:
            tar.extractall(source, filter="data")
        where = os.path.join(source, "cifar-10-batches-py", "data_batch_3")
    with pytest.raises(UnsafeFileError) as info:
        load_dataset("cifar10", data_dir=source)
    msg = str(info.value)
    assert msg.startswith(where + ": refusing to unpickle global '")
    assert ("os.system" in msg or "posix.system" in msg or "nt.system" in msg) if payload == "os.system" else \
        ("getattr" in msg or "pathlib" in msg)
    assert "numpy arrays" in msg
    assert not marker.exists()


def _replace_numpy_names(raw: bytes, new: bytes) -> bytes:
    # protocol 2 names globals as text ("c<module>\n<name>\n"): rewrite numpy 2's module names as numpy 1's
    out = raw.replace(b"numpy._core.", new)
    assert out != raw
    return out


@pytest.mark.parametrize("variant", ["numpy1-protocol2", "protocol2", "protocol4", "protocol5"])
def test_cifar_batches_of_every_numpy_and_protocol_load(tmp_path, variant):
    batches = [_batch(seed=i) for i in range(len(CIFAR10_FILES))]
    proto = 2 if variant.endswith("2") else int(variant[-1])
    raws = [pickle.dumps(b, protocol=proto) for b in batches]
    if variant.startswith("numpy1"):
        raws = [_replace_numpy_names(r, b"numpy.core.") for r in raws]
    archive = _write_archive(tmp_path / "cifar-10-python.tar.gz", dict(zip(CIFAR10_FILES, raws)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy.core deprecation warning either
        bundle = load_dataset("cifar10", data_dir=archive)
    want = np.concatenate([b[b"data"] for b in batches[:5]]).reshape(-1, 3, 32, 32)
    assert torch.equal(bundle.train.images, torch.from_numpy(want))
    assert bundle.test.labels.tolist() == batches[5][b"labels"]


def test_unpickler_refuses_other_codecs_and_non_dicts(tmp_path):
    class Rot13:
        def __reduce__(self):
            import _codecs
            return (_codecs.encode, ("abc", "rot13"))

    with pytest.raises(ValueError, match="f.bin: not a readable CIFAR batch"):
        _safe_io.unpickle_cifar(io.BytesIO(pickle.dumps(Rot13(), protocol=2)), "f.bin")
    with pytest.raises(ValueError, match="f.bin: not a CIFAR batch .*list"):
        _safe_io.unpickle_cifar(io.BytesIO(pickle.dumps([1, 2])), "f.bin")
    with pytest.raises(ValueError, match="f.bin: not a readable CIFAR batch"):
        _safe_io.unpickle_cifar(io.BytesIO(pickle.dumps(_batch())[:100]), "f.bin")


def _link(name, target, kind):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info


@pytest.mark.parametrize("bad", ["dotdot", "nested-dotdot", "absolute", "symlink", "hardlink", "fifo"])
def test_archive_with_unsafe_member_is_refused(tmp_path, bad):
    members = _good_members()
    evil = {
        "dotdot": ("../evil", pickle.dumps({})),
        "nested-dotdot": ("cifar-10-batches-py/../../evil", pickle.dumps({})),
        "absolute": (str(tmp_path / "evil"), pickle.dumps({})),
        "symlink": ("cifar-10-batches-py/link", _link("cifar-10-batches-py/link", "/etc/passwd", tarfile.SYMTYPE)),
        "hardlink": ("cifar-10-batches-py/link", _link("cifar-10-batches-py/link", "/etc/passwd", tarfile.LNKTYPE)),
        "fifo": ("cifar-10-batches-py/fifo", _link("cifar-10-batches-py/fifo", "", tarfile.FIFOTYPE)),
    }[bad]
    members[evil[0]] = evil[1]
    os.makedirs(tmp_path / "data")
    archive = _write_archive(tmp_path / "data" / "cifar-10-python.tar.gz", members)
    with pytest.raises(UnsafeFileError, match=f"^{re.escape(archive)}: refusing archive member '"):
        load_dataset("cifar10", data_dir=str(tmp_path / "data"))
    assert sorted(os.listdir(tmp_path)) == ["data"] and os.listdir(tmp_path / "data") == ["cifar-10-python.tar.gz"]
    # the same archive without the bad member loads
    del members[evil[0]]
    _write_archive(archive, members)
    assert len(load_dataset("cifar10", data_dir=archive).train) == 50


# --------------------------------------------------------------------------
# Downloads
# --------------------------------------------------------------------------
def test_published_checksums_are_torchvisions():
    assert data._CIFAR["cifar10"]["md5"] == "c58f30108f718f92721af3b95e74349a"
    assert data._CIFAR["cifar100"]["md5"] == "eb9058c3a382ffc7106e4002c42a8d85"


@pytest.mark.parametrize("failure", ["corrupt", "network", "interrupted"])
def test_failed_download_is_refused_and_leaves_nothing(tmp_path, monkeypatch, failure):
    calls = []

    def fetch(url, f):
        calls.append(url)
        f.write(b"not the CIFAR archive" * 1000)
        f.flush()
        assert len(os.listdir(tmp_path / "data")) == 1  # the partial file, next to the destination
        if failure == "network":
            raise OSError("connection reset")
        if failure == "interrupted":
            raise KeyboardInterrupt

    monkeypatch.setattr(data, "_fetch", fetch)
    expected = {"corrupt": (RuntimeError, "md5 is .*, not the published c58f30108f718f92721af3b95e74349a"),
                "network": (RuntimeError, "could not download .*connection reset"),
                "interrupted": (KeyboardInterrupt, None)}[failure]
    with pytest.raises(expected[0], match=expected[1]):
        load_dataset("cifar10", data_dir=str(tmp_path / "data"), download=True)
    assert calls == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]
    assert os.listdir(tmp_path / "data") == []
    assert sorted(os.listdir(tmp_path)) == ["data"]


def test_verified_download_is_kept_and_loads(tmp_path, monkeypatch):
    archive = _write_archive(tmp_path / "source.tar.gz", _good_members())
    raw = open(archive, "rb").read()
    monkeypatch.setitem(data._CIFAR["cifar10"], "md5", hashlib.md5(raw).hexdigest())
    monkeypatch.setattr(data, "_fetch", lambda url, f: f.write(raw))
    bundle = load_dataset("cifar10", data_dir=str(tmp_path / "data"), download=True)
    assert len(bundle.train) == 50 and len(bundle.test) == 10
    assert os.listdir(tmp_path / "data") == ["cifar-10-python.tar.gz"]
    assert open(tmp_path / "data" / "cifar-10-python.tar.gz", "rb").read() == raw


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
QUICK = ["--quick", "--dataset", "synthetic", "--methods", "grad", "--epochs", "1", "--block-size", "3",
         "--threads", "1", "--progress", "never", "--device", "cpu"]  # auto would pick CUDA where there is one


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_malicious_checkpoint_is_refused_on_resume_and_runs_nothing(tmp_path, payload):
    out = str(tmp_path / "run")
    ex.main(QUICK + ["--out", out])
    path = os.path.join(out, "checkpoints", "grad-seed0.pt")
    good = torch.load(path, weights_only=True)
    assert good["epoch"] == 1 and "layer1.0.conv1._extra_state" in good["model"]

    marker = tmp_path / "MARKER"
    good["rows"].append(PAYLOADS[payload](marker))
    torch.save(good, path)
    # the payload is live: torch.load(weights_only=False) runs it
    live = tmp_path / "live"
    torch.save({"x": PAYLOADS[payload](live)}, tmp_path / "live.pt")
    torch.load(tmp_path / "live.pt", weights_only=False)
    assert live.exists()

    with pytest.raises(UnsafeFileError, match=f"^{re.escape(path)}: refusing to unpickle global '.*weights_only=True"):
        ex.main(QUICK + ["--out", out, "--resume", "--epochs", "2"])
    assert not marker.exists()
    with pytest.raises(UnsafeFileError, match=f"^{re.escape(path)}: refusing to unpickle global"):
        _safe_io.load_checkpoint(path)
    assert not marker.exists()


def test_checkpoints_hold_plain_values_and_older_ones_still_load(tmp_path):
    np.random.seed(3)
    state = np.random.get_state()
    plain = _safe_io.numpy_rng_to_plain(state)
    path = str(tmp_path / "ck.pt")
    _safe_io.save_checkpoint({"rng": {"numpy": plain, "python": random.getstate(), "torch": torch.get_rng_state()},
                              "rows": [{"epoch": 1, "acc": 0.5, "note": None}]}, path)
    back = _safe_io.numpy_rng_from_plain(_safe_io.load_checkpoint(path)["rng"]["numpy"])
    np.random.set_state(back)
    x = np.random.rand(3)
    np.random.set_state(state)
    assert np.array_equal(x, np.random.rand(3))
    # anything else is refused when saving, and nothing is left behind
    with pytest.raises(TypeError, match=r"bad.pt: cannot save checkpoint\['rows'\]\[0\] is a numpy.float64"):
        _safe_io.save_checkpoint({"rows": [np.float64(1.0)]}, str(tmp_path / "bad.pt"))
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]


def test_checkpoints_written_before_issue_16_load_where_torch_admits_their_numpy_state(tmp_path):
    """Written before issue 16: numpy's random state as an array. It loads where torch can admit just those numpy
    globals (``torch.serialization.safe_globals``, torch >= 2.5); an older torch refuses it, naming the global."""
    state = np.random.get_state()
    torch.save({"rng": {"numpy": state}}, tmp_path / "old.pt")
    if not hasattr(torch.serialization, "safe_globals"):
        with pytest.raises(UnsafeFileError, match="refusing to unpickle global 'numpy.*_reconstruct'"):
            _safe_io.load_checkpoint(str(tmp_path / "old.pt"))
        return
    old = _safe_io.load_checkpoint(str(tmp_path / "old.pt"))["rng"]["numpy"]
    assert np.array_equal(_safe_io.numpy_rng_from_plain(old)[1], state[1])


@needs((2, 6), "torch.serialization.get_unsafe_globals_in_checkpoint")
def test_checkpoints_hold_no_global_that_weights_only_refuses(tmp_path):
    path = str(tmp_path / "ck.pt")
    _safe_io.save_checkpoint({"rng": {"numpy": _safe_io.numpy_rng_to_plain(np.random.get_state()),
                                      "python": random.getstate(), "torch": torch.get_rng_state()},
                              "rows": [{"epoch": 1, "acc": 0.5, "note": None}]}, path)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
