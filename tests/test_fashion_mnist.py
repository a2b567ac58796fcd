"""Fashion-MNIST: the IDX reader (good and malformed files) and the loader, on tiny files written here."""
import gzip
import hashlib
import os
import struct

import numpy as np
import pytest

from whitenlayers.experiment import data
from whitenlayers.experiment.data import IDXFormatError, load_dataset, read_idx

STEMS = {"train-images": "train-images-idx3-ubyte", "train-labels": "train-labels-idx1-ubyte",
         "test-images": "t10k-images-idx3-ubyte", "test-labels": "t10k-labels-idx1-ubyte"}


def idx_bytes(array: np.ndarray, dtype_code: int = 0x08) -> bytes:
    return bytes([0, 0, dtype_code, array.ndim]) + b"".join(struct.pack(">i", d) for d in array.shape) + \
        array.astype(np.uint8).tobytes()


def write(path, payload: bytes, gz: bool) -> str:
    path = str(path) + (".gz" if gz else "")
    with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
        f.write(payload)
    return path


def tiny_dataset(folder, n_train=30, n_test=10, gz=True, **overrides):
    rng = np.random.default_rng(0)
    arrays = {"train-images": rng.integers(0, 256, (n_train, 28, 28)), "train-labels": np.arange(n_train) % 10,
              "test-images": rng.integers(0, 256, (n_test, 28, 28)), "test-labels": np.arange(n_test) % 10}
    arrays.update(overrides)
    os.makedirs(folder, exist_ok=True)
    for key, stem in STEMS.items():
        write(os.path.join(folder, stem), idx_bytes(np.asarray(arrays[key])), gz)
    return arrays


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "raw"])
def test_read_idx_round_trips(tmp_path, gz):
    a = np.arange(2 * 3 * 4).reshape(2, 3, 4) % 256
    path = write(tmp_path / "x-idx3-ubyte", idx_bytes(a), gz)
    out = read_idx(path, 3)
    assert out.dtype == np.uint8 and out.shape == (2, 3, 4) and np.array_equal(out, a)


@pytest.mark.parametrize("payload, message", [
    (b"\x01\x00\x08\x01" + struct.pack(">i", 3) + b"abc", "not an IDX file"),
    (b"", "not an IDX file"),
    (b"\x00\x00\x0d\x01" + struct.pack(">i", 3) + b"abc", "element type 0x0d"),
    (b"\x00\x00\x08\x02" + struct.pack(">i", 3) + struct.pack(">i", 1) + b"abc", "2 dimensions, expected 1"),
    (b"\x00\x00\x08\x01\x00\x00", "truncated header"),
    (b"\x00\x00\x08\x01" + struct.pack(">i", 0), "must be positive"),
    (b"\x00\x00\x08\x01" + struct.pack(">i", 5) + b"abc", "truncated: 11 bytes, expected 13"),
    (b"\x00\x00\x08\x01" + struct.pack(">i", 2) + b"abc", "longer than its dimensions say"),
])
def test_malformed_idx_files_are_refused_naming_the_file(tmp_path, payload, message):
    path = write(tmp_path / "bad-idx1-ubyte", payload, gz=False)
    with pytest.raises(IDXFormatError, match=message) as info:
        read_idx(path, 1)
    assert path in str(info.value)


def test_a_truncated_gzip_stream_is_refused(tmp_path):
    good = write(tmp_path / "x-idx1-ubyte", idx_bytes(np.arange(100)), gz=True)
    with open(good, "rb") as f:
        raw = f.read()
    with open(good, "wb") as f:
        f.write(raw[: len(raw) // 2])
    with pytest.raises(IDXFormatError, match="not a readable gzip IDX file"):
        read_idx(good, 1)


@pytest.mark.parametrize("sub", ["", "fashion-mnist"])
def test_loader_reads_the_official_split_from_data_dir(tmp_path, monkeypatch, sub):
    monkeypatch.setitem(data._FASHION, "system_dir", str(tmp_path / "nowhere"))
    arrays = tiny_dataset(tmp_path / sub, gz=(sub == ""))
    bundle = load_dataset("fashion-mnist", data_dir=str(tmp_path))
    assert (len(bundle.train), len(bundle.test), bundle.num_classes, bundle.in_channels) == (30, 10, 10, 1)
    assert bundle.train.images.shape == (30, 1, 28, 28)
    assert np.array_equal(bundle.train.images[:, 0].numpy(), arrays["train-images"])
    assert np.array_equal(bundle.test.labels.numpy(), arrays["test-labels"])
    x, y = bundle.train.batch(__import__("torch").arange(4))
    assert x.shape == (4, 1, 28, 28) and x.dtype.is_floating_point


def test_loader_falls_back_to_the_system_folder(tmp_path, monkeypatch):
    tiny_dataset(tmp_path / "system")
    monkeypatch.setitem(data._FASHION, "system_dir", str(tmp_path / "system"))
    assert len(load_dataset("fashion-mnist", data_dir=str(tmp_path / "empty")).train) == 30


@pytest.mark.parametrize("override, message", [
    ({"train-labels": np.arange(29) % 10}, "holds 30 images but .* 29 labels"),
    ({"test-labels": np.full(10, 10)}, "label 10, expected 0..9"),
    ({"test-images": np.zeros((10, 27, 28))}, "27x28, expected 28x28"),
])
def test_inconsistent_files_are_refused(tmp_path, monkeypatch, override, message):
    monkeypatch.setitem(data._FASHION, "system_dir", str(tmp_path / "nowhere"))
    tiny_dataset(tmp_path, **override)
    with pytest.raises(IDXFormatError, match=message):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_missing_files_say_where_they_were_looked_for(tmp_path, monkeypatch):
    monkeypatch.setitem(data._FASHION, "system_dir", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist.*--download"):
        load_dataset("fashion-mnist", data_dir=str(tmp_path))


def test_download_checks_the_published_md5(tmp_path, monkeypatch):
    """--download fetches each missing file through the safe path: kept only with its published md5."""
    src = tmp_path / "src"
    tiny_dataset(src)
    files = {stem: (src / (stem + ".gz")).read_bytes() for stem in STEMS.values()}
    spec = dict(data._FASHION, system_dir=str(tmp_path / "nowhere"),
                files={k: (stem, hashlib.md5(files[stem]).hexdigest()) for k, stem in STEMS.items()})
    monkeypatch.setattr(data, "_FASHION", spec)
    fetched = []

    def fetch(url, f):
        fetched.append(url.rsplit("/", 1)[1])
        f.write(files[url.rsplit("/", 1)[1][: -len(".gz")]])

    monkeypatch.setattr(data, "_fetch", fetch)
    out = tmp_path / "data"
    assert len(load_dataset("fashion-mnist", data_dir=str(out), download=True).test) == 10
    assert sorted(fetched) == sorted(stem + ".gz" for stem in STEMS.values())
    assert sorted(os.listdir(out)) == sorted(stem + ".gz" for stem in STEMS.values())
    # a corrupt download is refused and leaves nothing
    spec["files"]["test-labels"] = (STEMS["test-labels"], "0" * 32)
    (out / (STEMS["test-labels"] + ".gz")).unlink()
    with pytest.raises(RuntimeError, match="md5"):
        load_dataset("fashion-mnist", data_dir=str(out), download=True)
    assert not any(name.startswith(STEMS["test-labels"]) for name in os.listdir(out))


@pytest.mark.skipif(not os.path.isfile("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_the_real_files_when_installed():
    bundle = load_dataset("fashion-mnist", data_dir="/nonexistent")
    assert (len(bundle.train), len(bundle.test)) == (60000, 10000)
    assert sorted(set(bundle.train.labels.tolist())) == list(range(10))
