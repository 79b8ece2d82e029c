"""torch's ``roundup_power2_divisions`` setting (``PYTORCH_CUDA_ALLOC_CONF``,
or ``torch._C._accelerator_setAllocatorSettings`` at run time) on the
simulated GPU, under the allocator named by ``QUILT_SIM_ALLOCATOR`` (see
``test_simulated_gpu.py``); torch's own allocator and Quilt answer alike: a
request is rounded up to the next of the given number of equal steps
between two powers of two (the single value for every size, or one per
size interval in the list form), its block that size, its requested bytes
those asked for; set again without it, requests are not rounded so.
"""

import gc
import os
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")

if ALLOCATOR == "quilt":
    import quilt_torch

    quilt_torch.enable()

import torch  # noqa: E402  (after enable(), which must come first)

MiB = 1 << 20


def stat(key):
    return torch.cuda.memory_stats()[key]


def settings(text):
    torch._C._accelerator_setAllocatorSettings(text)


class RoundupPower2Divisions(unittest.TestCase):
    def setUp(self):
        gc.collect()
        torch.cuda.empty_cache()

    def tearDown(self):
        settings("roundup_power2_divisions:1")

    def block_of(self, nbytes):
        """The active and requested bytes a request of `nbytes` adds."""
        active = stat("active_bytes.all.allocated")
        requested = stat("requested_bytes.all.allocated")
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        got = (stat("active_bytes.all.allocated") - active, stat("requested_bytes.all.allocated") - requested)
        del t
        return got

    def test_one_value_rounds_every_request_to_its_steps(self):
        settings("roundup_power2_divisions:4")
        # 84 MiB: between 64 and 128 MiB, four steps of 16 MiB: 96 MiB.
        self.assertEqual(self.block_of(84 * MiB), (96 * MiB, 84 * MiB))
        # A step exactly, and a power of two, stay as they are.
        self.assertEqual(self.block_of(80 * MiB), (80 * MiB, 80 * MiB))
        self.assertEqual(self.block_of(64 * MiB), (64 * MiB, 64 * MiB))
        settings("roundup_power2_divisions:1")
        self.assertEqual(self.block_of(84 * MiB), (84 * MiB, 84 * MiB))

    def test_the_list_form_rounds_each_interval_by_its_own_steps(self):
        settings("roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]")
        # 84 MiB is in the 64 MiB interval: eight steps of 8 MiB: 88 MiB.
        self.assertEqual(self.block_of(84 * MiB), (88 * MiB, 84 * MiB))
        # 400 MiB is in the 256 MiB interval: two steps of 128 MiB: 512 MiB.
        self.assertEqual(self.block_of(400 * MiB), (512 * MiB, 400 * MiB))
        # 1100 MiB: one step, no rounding but to blocks.
        self.assertEqual(self.block_of(1100 * MiB), (1100 * MiB, 1100 * MiB))


if __name__ == "__main__":
    unittest.main()
