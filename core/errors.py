"""One exception hierarchy for every rejected call.

Every public operation of the core validates its arguments before it changes
anything, so catching a ``VTokenError`` means the state is exactly what it was
before the call. Each class names one kind of mistake; the message names the
request, token, block or slot at fault.
"""


class VTokenError(Exception):
    """Root of every error the core raises on bad input or an impossible request."""


class UnknownRequestError(VTokenError):
    """The request id is not registered (never added, finished, or preempted)."""


class DuplicateRequestError(VTokenError):
    """A request id was registered twice."""


class TokenOutOfRangeError(VTokenError):
    """A token id is negative or not yet synced for this request."""


class TokenAlreadyEvictedError(VTokenError):
    """The token was evicted before (double eviction), or a move names a dead token."""


class BlockOutOfRangeError(VTokenError):
    """A block id lies outside the pool."""


class BlockNotOwnedError(VTokenError):
    """A block is not the request's to use, or already is in its list when it must not be.

    Not in the request's block list; free in the pool; in another request's block list without being a
    full, shared prefix block that the pool's reference count covers; or reserved by a relocation plan.
    """


class BlockListTooShortError(VTokenError):
    """The request's blocks cannot hold its tokens (sync_new_tokens)."""


class MoveSourceMismatchError(VTokenError):
    """A move's source (block, offset) is not where the table says the token lives (stale move)."""


class DestinationError(VTokenError):
    """A move's destination is out of range, already claimed, or claimed twice in one batch."""


class DoubleFreeError(VTokenError):
    """A block that is not allocated was freed or shared."""


class PoolExhaustedError(VTokenError):
    """Not enough free blocks for the allocation."""


class HeadroomReservedError(PoolExhaustedError):
    """An admission allocation would dip into the evacuation headroom."""


class AdmissionClosedError(PoolExhaustedError):
    """Backpressure: reclamation has borrowed the headroom; admit after it settles (Stage 2)."""


class PlanConflictError(VTokenError):
    """A plan overlaps an in-flight plan on the same request, or its snapshot is stale (I4)."""


class UnknownCopyHandleError(VTokenError):
    """The copy handle was never issued by this engine, or its copy was already released."""


class CopyStateError(VTokenError):
    """The copy is in a state the call does not allow (releasing a pending copy, completing a settled one)."""


class RequestStillRegisteredError(VTokenError):
    """``on_request_removed`` for a request still in the token table (remove it from the table first)."""


class ConfigError(VTokenError):
    """A configuration value is out of its allowed range."""


class InvalidArgumentError(VTokenError):
    """An argument has the wrong type or shape, or a value no more specific class covers.

    For example an unhashable request id, a bool, float or string where an int is meant, a Purpose
    given as anything but a member or its value, an attention row with NaN, infinite, negative or bool
    weights, a row for a request that was not in the step. The message names the argument and repeats
    the value.
    """


class StepOrderError(VTokenError):
    """``begin_step`` and ``end_step`` were called out of order (end without begin, begin twice)."""


class PolicyError(VTokenError):
    """The eviction policy failed or returned victims the runtime refuses (dead, protected, repeated,
    not ints, or more than the request's excess). Nothing was evicted."""


class InvariantViolation(AssertionError):
    """An executable invariant (I1-I7) does not hold. Never raised for bad input: it means a bug."""

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"{invariant}: {message}")
        self.invariant = invariant
