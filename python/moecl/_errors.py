"""The exceptions a failed C call becomes."""

from __future__ import annotations

from typing import Dict, Type


class Error(Exception):
    """A moecl C call failed.

    Attributes:
        status: the moecl_status (library codes <= -2000, or the negative
            OpenCL error code passed through).
        status_string: moecl_status_string(status), e.g. "invalid argument".
        message: moecl_context_error()'s detail, e.g. which field was wrong.
    """

    def __init__(self, status: int, status_string: str, message: str) -> None:
        self.status = status
        self.status_string = status_string
        self.message = message
        super().__init__("%s (%d): %s" % (status_string, status, message) if message
                         else "%s (%d)" % (status_string, status))


class InvalidArgumentError(Error, ValueError):
    """MOECL_ERROR_INVALID_ARGUMENT: a field or buffer out of range; nothing ran."""


class UnsupportedError(Error):
    """MOECL_ERROR_UNSUPPORTED: a valid request this device or build cannot serve."""


class NoDeviceError(Error):
    """MOECL_ERROR_NO_DEVICE: no OpenCL device, or none matches the selector."""


class BuildError(Error):
    """MOECL_ERROR_BUILD: kernel compilation failed; the message holds the log."""


class OutOfMemoryError(Error, MemoryError):
    """MOECL_ERROR_OUT_OF_MEMORY: a host allocation failed."""


class OpenCLError(Error):
    """An OpenCL error code passed through (CL_OUT_OF_RESOURCES, ...)."""


_BY_STATUS: Dict[int, Type[Error]] = {
    -2000: InvalidArgumentError,
    -2001: UnsupportedError,
    -2002: NoDeviceError,
    -2003: BuildError,
    -2004: OutOfMemoryError,
}


def error_class(status: int) -> Type[Error]:
    """The exception class for a failed call's status."""
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return OpenCLError if -2000 < status < 0 else Error
