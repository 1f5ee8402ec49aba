"""common.data and common.models: shapes, determinism, and clear errors, all offline.

CIFAR-10 and ImageNet are exercised on tiny files the tests write in the real on-disk
formats, so the loaders are the ones a real run uses.
"""

import pickle
import re

import numpy as np
import pytest
import torch

from common.data import (
    DATA_DIR,
    DATASET_SHAPES,
    cifar10,
    get_dataset,
    image_folder,
    load_digits,
    synthetic_classification,
)
from common.models import MODEL_NAMES, MLP, SmallCNN, build_model

# ---------------------------------------------------------------------------- digits


def test_digits_shapes_dtypes_and_range():
    for split, n in [("train", 1437), ("test", 360)]:
        x, y = load_digits(split).tensors
        assert x.shape == (n, 1, 8, 8) and x.dtype == torch.float32
        assert y.shape == (n,) and y.dtype == torch.int64
        assert x.min() >= 0 and x.max() <= 1 and x.max() == 1  # pixel 16 -> 1.0
        assert set(y.tolist()) == set(range(10))
    assert DATASET_SHAPES["digits"] == ((1, 8, 8), 10)


def test_digits_split_is_disjoint_and_deterministic():
    train, test = load_digits("train").tensors[0], load_digits("test").tensors[0]
    train_rows = {tuple(r) for r in train.flatten(1).tolist()}
    test_rows = {tuple(r) for r in test.flatten(1).tolist()}
    assert len(train_rows) == 1437 and len(test_rows) == 360  # the file has no duplicate rows
    assert not train_rows & test_rows
    assert torch.equal(load_digits("train").tensors[0], train)
    # Pinned so a change in numpy's permutation stream (or in the file) cannot go unnoticed.
    assert load_digits("train").tensors[1][:10].tolist() == [6, 6, 6, 2, 5, 6, 6, 2, 2, 1]
    assert load_digits("test").tensors[1][:10].tolist() == [0, 8, 8, 9, 8, 3, 7, 5, 0, 6]
    # Mutating a returned tensor must not leak into the next call (the parse is cached).
    train.zero_()
    assert load_digits("train").tensors[0].max() == 1


def test_digits_split_covers_every_row_with_its_label():
    parts = [load_digits(split).tensors for split in ("train", "test")]
    x = torch.cat([p[0] for p in parts]).flatten(1).mul(16).round().long()
    y = torch.cat([p[1] for p in parts])
    ours = sorted(map(tuple, torch.cat([x, y[:, None]], dim=1).tolist()))
    raw = np.loadtxt(DATA_DIR / "digits.csv.gz", delimiter=",", dtype=np.int64)
    assert ours == sorted(map(tuple, raw.tolist()))


def test_digits_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        load_digits("train", root=tmp_path)
    with pytest.raises(ValueError, match="train"):
        load_digits("validation")


# ------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_labelled_by_one_teacher():
    a, b = synthetic_classification(seed=3), synthetic_classification(seed=3)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])
    x, y = a.tensors
    assert x.shape == (1024, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.min() >= 0 and y.max() <= 9 and len(y.unique()) == 10
    other = synthetic_classification(seed=4)
    assert not torch.equal(other.tensors[0], x)

    # get_dataset's train and test are different samples labelled by one rule:
    # the teacher drawn from teacher_seed=0.
    teacher = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    train, test = get_dataset("synthetic", "train"), get_dataset("synthetic", "test")
    assert len(train) == 1024 and len(test) == 256
    assert not torch.equal(train.tensors[0][:256], test.tensors[0])
    for ds in (train, test):
        assert torch.equal((ds.tensors[0].flatten(1) @ teacher.T).argmax(1), ds.tensors[1])
    relabelled = synthetic_classification(seed=3, teacher_seed=1)
    assert torch.equal(relabelled.tensors[0], x) and not torch.equal(relabelled.tensors[1], y)


def test_synthetic_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    synthetic_classification(n=8)
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------- CIFAR-10


def _write_cifar(root, per_batch=2):
    """Tiny CIFAR-10 in the real format: pixel i of image k of batch b is (k*3072 + i + b*7) % 256.

    The real files are Python 2 pickles whose byte-string keys load as str under
    pickle.load(f, encoding="latin1"), which is how torchvision reads them; str keys
    here give torchvision the same dict.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir()
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for b, name in enumerate(names):
        data = (np.arange(per_batch * 3072).reshape(per_batch, 3072) + b * 7) % 256
        entry = {"data": data.astype(np.uint8), "labels": [(b + k) % 10 for k in range(per_batch)]}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
    meta = {"label_names": [f"class{i}" for i in range(10)]}
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f)
    return folder


def test_cifar10_reads_real_format(tmp_path):
    _write_cifar(tmp_path)
    train, test = cifar10(tmp_path, train=True), cifar10(tmp_path, train=False, augment=True)
    assert len(train) == 10 and len(test) == 2
    assert train.targets == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5] and test.targets == [5, 6]
    # torchvision stores CHW rows as HWC uint8; pixel (c, h, w) is flat index c*1024 + h*32 + w.
    raw = (np.arange(3072) + 5 * 7) % 256
    assert np.array_equal(test.data[0], raw.reshape(3, 32, 32).transpose(1, 2, 0))
    x, y = train[3]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 2
    assert test[0][0].shape == (3, 32, 32)
    via_get = get_dataset("cifar10", "val", root=tmp_path)
    assert len(via_get) == 2 and torch.equal(via_get[1][0], cifar10(tmp_path, train=False)[1][0])


def test_cifar10_pickles_for_spawned_workers(tmp_path, monkeypatch):
    import common.data

    _write_cifar(tmp_path)
    blob = pickle.dumps([cifar10(tmp_path, train=False), cifar10(tmp_path, train=False)])
    # A spawned DataLoader worker starts with a fresh common.data: no _CIFAR10 yet.
    monkeypatch.delitem(vars(common.data), "_CIFAR10")
    first, second = pickle.loads(blob)
    assert type(first) is type(second) and type(first).__name__ == "_CIFAR10"
    assert second.targets == [5, 6] and second[0][0].shape == (3, 32, 32)


def test_cifar10_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data/README.md"):
        cifar10(tmp_path)
    with pytest.raises(ValueError, match="--data-root"):
        get_dataset("cifar10")
    folder = _write_cifar(tmp_path)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        cifar10(tmp_path)


# --------------------------------------------------------------------------- ImageNet


def _write_image_folder(root, splits=("train", "val")):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in splits:
        for cls in ("n01440764", "n01443537"):
            (root / split / cls).mkdir(parents=True)
            for i in range(2):
                pixels = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{split}_{i}.png")


def test_image_folder(tmp_path):
    _write_image_folder(tmp_path)
    train = image_folder(tmp_path, "train", image_size=32, augment=True)
    val = image_folder(tmp_path, "val", image_size=32)
    assert len(train) == 4 and len(val) == 4
    assert train.classes == ["n01440764", "n01443537"]
    for ds in (train, val):
        x, y = ds[3]
        assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 1
    via_get = get_dataset("imagenet", "test", root=tmp_path, image_size=32)
    assert [p.split("/")[-1] for p, _ in via_get.samples][0].startswith("val_")
    assert DATASET_SHAPES["imagenet"] == ((3, 224, 224), 1000)


def test_image_folder_errors(tmp_path):
    _write_image_folder(tmp_path, splits=("train",))
    with pytest.raises(FileNotFoundError, match="val"):
        image_folder(tmp_path, "val")
    (tmp_path / "val").mkdir()  # a split folder with no class folders
    with pytest.raises(FileNotFoundError, match="ImageFolder layout"):
        image_folder(tmp_path, "val")
    with pytest.raises(ValueError, match="--data-root"):
        get_dataset("imagenet", "val")


def test_get_dataset_rejects_bad_names():
    with pytest.raises(ValueError, match="digits, synthetic, cifar10, imagenet"):
        get_dataset("mnist")
    with pytest.raises(ValueError, match="split"):
        get_dataset("digits", "holdout")
    assert len(get_dataset("digits", "val")) == 360


# ---------------------------------------------------------------------------- models


def test_build_model_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(5)
    torch.manual_seed(7)
    a = build_model("cnn", seed=1).state_dict()
    b = build_model("cnn", seed=1).state_dict()
    assert torch.equal(torch.rand(5), expected)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = build_model("cnn", seed=2).state_dict()
    assert not torch.equal(a["head.weight"], c["head.weight"])


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_small_models_forward(name):
    assert build_model(name)(torch.randn(4, 1, 8, 8)).shape == (4, 10)


def test_resnet18_cifar_stem():
    model = build_model("resnet18", (3, 32, 32), 10)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert build_model("resnet18", (3, 224, 224), 1000).conv1.kernel_size == (7, 7)


def test_resnet50_builds():
    model = build_model("resnet50", (3, 224, 224), 1000)
    assert model.fc.out_features == 1000


def test_buffers():
    assert len(list(MLP(64).buffers())) == 0
    bn_buffers = [n for n, _ in SmallCNN().named_buffers()]
    assert "features.1.running_mean" in bn_buffers and "features.4.running_var" in bn_buffers


def test_build_model_errors():
    with pytest.raises(ValueError, match=", ".join(MODEL_NAMES)):
        build_model("lenet")
    with pytest.raises(ValueError, match="divisible by 16"):
        build_model("vit_b_16", (3, 40, 40))
