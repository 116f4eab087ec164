"""distdl: distributed deep learning over MPI with exact-adjoint data movement.

Importing distdl writes nothing: it logs through ``logging.getLogger("distdl")`` (a
``NullHandler``; attach your own handler to see the messages), and it installs the hooks of
:mod:`distdl.abort` so that an uncaught exception on any rank ends the whole MPI job (opt out with
``DISTDL_ABORT_ON_ERROR=0``). Check mode (:mod:`distdl.checks`; ``DISTDL_CHECK=1`` or
:func:`~distdl.checks.set_check_mode`) makes every collective first verify that all its ranks agree on the call.
"""

import logging

from distdl import abort

abort.install_from_environment()  # first: a setting refused below on one rank then ends the job, not just that rank

from distdl.backends import info  # noqa: E402
from distdl.checks import (CollectiveMismatchError, CollectiveTimeoutError, check_mode, checking,  # noqa: E402
                           set_check_mode)
from distdl.describe import describe  # noqa: E402
from distdl.partition import MPIPartition  # noqa: E402

from distdl import functional, nn, utilities  # noqa: E402  (they use MPIPartition)

__all__ = ["MPIPartition", "CollectiveMismatchError", "CollectiveTimeoutError", "check_mode", "checking", "describe",
           "functional", "info", "nn", "set_check_mode", "utilities", "__version__"]

__version__ = "0.1.0"

logging.getLogger("distdl").addHandler(logging.NullHandler())
