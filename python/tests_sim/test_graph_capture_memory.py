"""A serving engine's CUDA graph capture (``graph_capture_sizes.py``: 67
batch sizes, the largest first, into one shared private pool) reserves no
more under Quilt (``quilt_torch.enable()``) than under torch's own caching
allocator, give or take one 2 MiB page: at hidden widths 1024 and 4096, with
each graph's output kept and freed. Each capture runs in a python of its
own (``sys.executable`` with this environment, so on the same simulated
GPU), once under each allocator; both what the captures added to what was
reserved and all that is reserved after them are compared.

The comparison runs once, in the run of ``python/tests_sim`` under Quilt
(``QUILT_SIM_ALLOCATOR=quilt``); under torch's allocators it is skipped.
"""

import json
import os
import subprocess
import sys
import unittest

ALLOCATOR = os.environ.get("QUILT_SIM_ALLOCATOR", "classic")
HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "graph_capture_sizes.py")
MiB = 1 << 20
SLACK = 2 * MiB


def capture(allocator, width, mode):
    """The figures of one capture under `allocator` ("quilt" or "torch")."""
    env = dict(os.environ)
    env["QUILT_SIM_ALLOCATOR"] = allocator
    if allocator != "quilt":
        # torch's own caching allocator as it comes (not expandable segments).
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    done = subprocess.run(
        [sys.executable, PROGRAM, str(width), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        universal_newlines=True,
        timeout=600,
        env=env,
    )
    if done.returncode != 0:
        raise AssertionError(
            "{} {} {} failed ({}):\n{}".format(allocator, width, mode, done.returncode, done.stdout)
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


@unittest.skipUnless(
    ALLOCATOR == "quilt",
    "compares Quilt with torch's allocator once, in the run under QUILT_SIM_ALLOCATOR=quilt",
)
class GraphCaptureMemory(unittest.TestCase):
    def compare(self, width, mode):
        torch_ = capture("torch", width, mode)
        quilt = capture("quilt", width, mode)
        print(
            "\nwidth {} outputs {}: reserved MiB torch {:.0f} quilt {:.0f}; "
            "captures MiB torch {:.0f} quilt {:.0f}".format(
                width,
                mode,
                torch_["reserved"] / MiB,
                quilt["reserved"] / MiB,
                torch_["captures"] / MiB,
                quilt["captures"] / MiB,
            ),
            file=sys.stderr,
        )
        self.assertEqual((torch_["graphs"], quilt["graphs"]), (67, 67))
        self.assertLessEqual(quilt["captures"], torch_["captures"] + SLACK, (torch_, quilt))
        self.assertLessEqual(quilt["reserved"], torch_["reserved"] + SLACK, (torch_, quilt))
        # What torch holds after the captures is the same bytes under both.
        self.assertLessEqual(abs(quilt["allocated"] - torch_["allocated"]), 8 * MiB, (torch_, quilt))

    def test_width_1024_outputs_kept(self):
        self.compare(1024, "keep")

    def test_width_1024_outputs_freed(self):
        self.compare(1024, "free")

    def test_width_4096_outputs_kept(self):
        self.compare(4096, "keep")

    def test_width_4096_outputs_freed(self):
        self.compare(4096, "free")


if __name__ == "__main__":
    unittest.main()
