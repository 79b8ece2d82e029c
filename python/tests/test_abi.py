"""The C ABI the package, the C++ allocator class and the library share:
the generated header ``python/quilt_torch/quilt_torch.h`` (cbindgen, from
crates/torch). Standard library only; the library is ``$QUILT_TORCH_LIBRARY``
or the checkout's ``target/release/libquilt_torch.so``.

Run from the repository root::

    python3 -m unittest discover -s python/tests -v
"""

import ctypes
import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from quilt_torch import _clib  # noqa: E402  (after the path above)
from quilt_torch.errors import QuiltError  # noqa: E402


class HeaderAbi(unittest.TestCase):
    def setUp(self):
        self.path = _clib.library_path()
        self.lib = ctypes.CDLL(self.path)

    def test_every_function_of_the_header_is_in_the_library(self):
        found = _clib.prototypes()
        for name in ("quilt_malloc", "quilt_free", "quilt_stats_json", "quilt_torch_malloc",
                     "quilt_sleep", "quilt_abi_version", "quilt_pool_checkpoint"):
            self.assertIn(name, found)
        self.assertGreater(len(found), 30)
        for name in found:
            self.assertTrue(hasattr(self.lib, name), "{} lacks {}".format(self.path, name))

    def test_the_prototypes_read_from_the_header_type_pointers_and_sizes(self):
        found = _clib.prototypes()
        self.assertEqual(found["quilt_malloc"], ([ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p], ctypes.c_void_p))
        self.assertEqual(found["quilt_free"][1], None)
        self.assertEqual(found["quilt_sleep"], ([ctypes.c_char_p, ctypes.c_int], ctypes.c_int))
        self.assertEqual(found["quilt_set_memory_fraction"][0], [ctypes.c_double, ctypes.c_int])
        self.assertEqual(found["quilt_in_forked_child"], ([], ctypes.c_int))

    def test_the_library_has_the_headers_abi_version(self):
        self.lib.quilt_abi_version.restype = ctypes.c_uint32
        self.assertEqual(self.lib.quilt_abi_version(), _clib.abi_version())
        _clib.check_abi(self.lib, self.path)  # does not raise

    def test_a_library_of_another_abi_version_is_refused(self):
        folder = tempfile.mkdtemp(prefix="quilt-abi-")
        try:
            other = os.path.join(folder, "quilt_torch.h")
            with open(_clib.HEADER) as f, open(other, "w") as g:
                text = f.read()
                want = _clib.abi_version()
                g.write(text.replace(
                    "#define QUILT_TORCH_ABI_VERSION {}".format(want),
                    "#define QUILT_TORCH_ABI_VERSION {}".format(want + 1),
                ))
            kept, _clib.HEADER = _clib.HEADER, other
            try:
                with self.assertRaises(QuiltError) as raised:
                    _clib.check_abi(self.lib, self.path)
            finally:
                _clib.HEADER = kept
            message = str(raised.exception)
            for word in ("C ABI version {}".format(want), "expects {}".format(want + 1), "rebuild"):
                self.assertIn(word, message)
        finally:
            shutil.rmtree(folder)

    def test_the_sleep_flags_come_from_the_header(self):
        self.assertEqual(_clib.constant("QUILT_SLEEP_DISCARD"), 1)
        self.assertEqual(_clib.constant("QUILT_SLEEP_RELEASE"), 2)
        with self.assertRaises(QuiltError):
            _clib.constant("QUILT_NO_SUCH_CONSTANT")


if __name__ == "__main__":
    unittest.main()
