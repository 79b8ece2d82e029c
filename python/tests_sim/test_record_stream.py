"""``record_stream`` on the simulated GPU, under the allocator named by
``QUILT_SIM_ALLOCATOR`` (see ``test_simulated_gpu.py``): a tensor freed on
its stream while another stream it was recorded on still has work queued
(``torch.cuda._sleep`` keeps a stream busy on the double) is not reused by
the next tensor of its stream, which gets other memory, and no stream is
made to wait for another; once that work is done it is reused. That is
torch's own allocator's behaviour, and Quilt's. Under Quilt, only when
memory runs out is such a tensor's memory reused while the work may still
run, behind a wait for that stream, counted in ``num_recorded_frees_forced``.
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
# Long enough that the busy stream's work is still queued at the next
# allocation (the double runs queued work when waited for, or some hundred
# driver calls later).
SLEEP_CYCLES = 1 << 30


def quilt_counts():
    """Quilt's stream waits and forced recorded frees on device 0 (zeros
    under torch's own allocators)."""
    if ALLOCATOR != "quilt":
        return (0, 0)
    stats = quilt_torch.memory_stats(0)
    return (stats["num_stream_waits"], stats["num_recorded_frees_forced"])


def recorded_on_a_busy_stream(size):
    """A tensor of ``size`` bytes made on a stream of its own and recorded
    on another stream busy with a long kernel that waited for it: (its
    stream, the busy stream, the tensor, its address)."""
    own = torch.cuda.Stream()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(own):
        x = torch.empty(size, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(busy):
        busy.wait_stream(own)
        torch.cuda._sleep(SLEEP_CYCLES)
    x.record_stream(busy)
    return own, busy, x, x.data_ptr()


class RecordStream(unittest.TestCase):
    def setUp(self):
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()

    def test_a_block_recorded_on_a_busy_stream_is_not_reused_until_its_work_is_done(self):
        own, busy, x, ptr = recorded_on_a_busy_stream(3 * MiB)
        waits, forced = quilt_counts()
        del x
        with torch.cuda.stream(own):
            y = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        self.assertNotEqual(y.data_ptr(), ptr, "reused while the busy stream may use it")
        self.assertEqual(quilt_counts(), (waits, forced), "no stream made to wait")
        busy.synchronize()
        with torch.cuda.stream(own):
            z = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        self.assertEqual(z.data_ptr(), ptr, "reused once the work is done")
        self.assertEqual(quilt_counts(), (waits, forced), "no stream made to wait")
        del y, z
        torch.cuda.synchronize()

    @unittest.skipIf(ALLOCATOR != "quilt", "Quilt's counter of frees forced under pressure")
    def test_under_memory_pressure_the_block_is_reused_behind_a_wait_and_counted(self):
        total = torch.cuda.get_device_properties(0).total_memory
        limit = 96 * MiB
        torch.cuda.set_per_process_memory_fraction(limit / total, 0)
        try:
            own, busy, x, ptr = recorded_on_a_busy_stream(64 * MiB)
            waits, forced = quilt_counts()
            ooms = torch.cuda.memory_stats()["num_ooms"]
            del x
            # Two such blocks do not fit under the limit: the held one serves.
            with torch.cuda.stream(own):
                y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            self.assertEqual(y.data_ptr(), ptr, "the held block's memory, under pressure")
            self.assertEqual(quilt_counts(), (waits + 1, forced + 1))
            self.assertEqual(torch.cuda.memory_stats()["num_ooms"], ooms, "not an out-of-memory")
            del y
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    unittest.main()
