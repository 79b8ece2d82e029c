"""Tags, sleep and wake: the tensors allocated inside ``with tag(name):``
carry the tag; ``sleep(name)`` frees their device memory while their
addresses stay valid, ``wake(name)`` brings them back at the same
addresses."""

import contextlib

from ._clib import check, constant, last_error, library, read_string
from .errors import QuiltError


def _tag_bytes(name):
    """The tag as the C functions take it: a non-empty str without NUL."""
    if not isinstance(name, str):
        raise TypeError("a tag is a str, not {}".format(type(name).__name__))
    if not name:
        raise ValueError("a tag is not empty")
    if "\0" in name:
        raise ValueError("a tag holds no NUL character: {!r}".format(name))
    return name.encode("utf-8")


def current_tag():
    """Return the tag this thread's allocations carry now (None if none)."""
    return read_string(library().quilt_current_tag) or None


@contextlib.contextmanager
def tag(name):
    """Make this thread's allocations inside the block carry the tag ``name``.

    Like torch_memory_saver's ``region(tag)`` and vLLM's
    ``use_memory_pool(tag)``::

        with quilt_torch.tag("weights"):
            model = load_model().cuda()      # every block carries "weights"
        quilt_torch.sleep("weights")         # device memory freed
        quilt_torch.wake("weights")          # back, same addresses

    Tagged blocks live in pages of their own (never shared with other tags or
    untagged blocks). The tag belongs to the calling thread: allocations
    PyTorch makes on other threads (autograd's backward threads, for one) do
    not carry it. Blocks nest: the tag in force before the block is restored
    after it, even when it raises.

    Raises:
        TypeError, ValueError: for a tag that is not a non-empty str
            without NUL characters.
        QuiltError: if the library refuses the tag.
    """
    encoded = _tag_bytes(name)
    lib = library()
    previous = current_tag()
    check(lib.quilt_set_tag(encoded), "quilt_set_tag({!r})".format(name))
    try:
        yield name
    finally:
        if previous is None:
            lib.quilt_clear_tag()
        else:
            lib.quilt_set_tag(previous.encode("utf-8"))


def sleep(name, offload=True, release=False):
    """Put every block carrying the tag ``name`` to sleep, on every device.

    The work queued on them completes; their contents are copied to host
    memory (``offload=True``) or dropped (``offload=False``: after
    :func:`wake` their bytes are undefined, e.g. for a KV cache rebuilt
    anyway); their pages are unmapped and go back to Quilt's pool, where
    other allocations use them, or with ``release=True`` to the device
    (``cuMemRelease``), where other programs can use them. Their addresses
    stay reserved: pointers held elsewhere (a captured CUDA graph) are valid
    again after :func:`wake`. While asleep, the tensors must not be used,
    freed or given new members.

    Raises:
        QuiltError: for an unknown tag, one already asleep, or a failure;
            the message says which.
    """
    encoded = _tag_bytes(name)
    flags = (0 if offload else constant("QUILT_SLEEP_DISCARD")) | (
        constant("QUILT_SLEEP_RELEASE") if release else 0
    )
    check(library().quilt_sleep(encoded, flags), "quilt_sleep({!r})".format(name))


def wake(name):
    """Wake the tag ``name``: its blocks are backed again at the same
    addresses and their contents copied back (if they were offloaded).

    Raises:
        QuiltError: for an unknown tag, one that is awake, or a failure (out
            of memory leaves the tag asleep with its host copy intact).
    """
    check(library().quilt_wake(_tag_bytes(name)), "quilt_wake({!r})".format(name))


def is_asleep(name):
    """Return True while the tag ``name`` sleeps.

    Raises:
        QuiltError: for a tag no allocation carried.
    """
    rc = library().quilt_is_asleep(_tag_bytes(name))
    if rc < 0:
        raise QuiltError("quilt_is_asleep({!r}) failed: {}".format(name, last_error()))
    return rc == 1
