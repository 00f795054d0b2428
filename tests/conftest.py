import os

# Tests use only models and data that ship inside installed packages.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import warnings

import kernels
import pytest
import tolerance

kernels.apply()  # two threads, or the variant the environment names (tests/kernels.py)
tolerance.guard_stored_loads()  # stored references compare within a tolerance
tolerance.install_margin_record()  # with SLSAM_TEST_MARGINS set (tests/tolerance.py)


@pytest.fixture(autouse=True)
def _quiet_lightning():
    # Lightning's advice for tiny test loaders (few workers, log interval) is noise here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*log_every_n_steps.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*")
        yield


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path, monkeypatch):
    # Trainers without a logger write their records to the working directory.
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def example_methods():
    """The methods of examples/methods.py (``slsam_ablation``, ``slsam_saf``) known by name
    during the test."""
    from examples.methods import registered

    with registered():
        yield
