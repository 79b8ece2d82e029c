"""The errors quilt_torch raises."""


class QuiltError(RuntimeError):
    """An operation the library refused; the message is its last error."""


class ConfigurationError(QuiltError, ValueError):
    """``QUILT_ALLOC_CONF`` is invalid, or names a backend torch cannot use."""


class BridgeError(RuntimeError):
    """Quilt's allocator class for torch cannot be built or installed (the
    message says why, and names the torch version)."""
