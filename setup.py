"""The Rust half of `pip install .` (the rest is in pyproject.toml).

crates/torch's cdylib is built by cargo (release profile, the workspace's
target folder, or $CARGO_TARGET_DIR) and installed inside the package as
quilt_torch/libquilt_torch.abi3.so, where quilt_torch.library_path() finds
it. The version is the workspace's.
"""

import os
import sys

from setuptools import setup
from setuptools_rust import Binding, RustExtension

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

HERE = os.path.dirname(os.path.abspath(__file__))

# setuptools' scratch folder, inside the ignored target/ rather than build/
# and python/quilt_torch.egg-info in the checkout. egg_info wants it to exist.
# A config file overrides it (crates/torch/tests/pip_install.rs names one of
# its own through $DIST_EXTRA_CONFIG, so that runs at once do not share it).
SCRATCH = os.path.join(HERE, "target", "python-build")
os.makedirs(SCRATCH, exist_ok=True)


def workspace_version():
    with open(os.path.join(HERE, "Cargo.toml"), "rb") as f:
        return tomllib.load(f)["workspace"]["package"]["version"]


setup(
    version=workspace_version(),
    rust_extensions=[
        RustExtension(
            # The module name only places the file: quilt_torch/libquilt_torch
            # plus the extension suffix (.abi3.so, below). It is not imported.
            "quilt_torch.libquilt_torch",
            path=os.path.join("crates", "torch", "Cargo.toml"),
            binding=Binding.NoBinding,
            # Release also for editable installs (setuptools-rust's default
            # there is a debug build).
            debug=False,
            # The crate's own crate types, so that this build is the same
            # cargo unit as `cargo build --release -p quilt-torch` (the
            # README's development build): with setuptools-rust's default
            # (cdylib alone) each would rebuild quilt-torch after the other.
            args=["--crate-type", "cdylib", "--crate-type", "rlib"],
        )
    ],
    # The library calls no Python C API (it is loaded with ctypes), so the
    # wheel holds for every CPython 3 from 3.9 (setuptools 77's least): a
    # stable-ABI (abi3) wheel, hence the file's .abi3.so suffix.
    options={
        "bdist_wheel": {"py_limited_api": "cp39"},
        "build": {"build_base": SCRATCH},
        "egg_info": {"egg_base": SCRATCH},
    },
)
