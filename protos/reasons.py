"""Every reason the coordinator may refuse a request, in one enum.

Reasons are part of the contract: the coordinator sends the code in the ``x-veriroll-reason``
trailer and as the prefix of the status message (``"lease_expired: ..."``), counts it per node and
globally, and the node shows it to its operator. ``strike`` marks the reasons that only a dishonest
or broken node produces: they count towards a ban. Clock skew, an expired lease or a stale version
can happen to anyone and never strike; nor does a missing proof of work or a full budget of new keys
(docs/registration.md): those refuse a key that has no history yet; nor does a key already running in
another node process, or a release older than the coordinator accepts.
"""

from __future__ import annotations

import enum

import grpc


class Reason(str, enum.Enum):
    # door: envelope, identity, limits
    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_KEY = "unknown_key"
    BAD_KEY = "bad_key"
    CLOCK_SKEW = "clock_skew"
    REPLAYED_NONCE = "replayed_nonce"
    BANNED = "banned"
    RATE_LIMITED = "rate_limited"
    MESSAGE_TOO_LARGE = "message_too_large"
    MALFORMED = "malformed"
    DEADLINE_REQUIRED = "deadline_required"
    # the cost of a new identity (protos/pow.py, coordinator/admission.py)
    POW_REQUIRED = "pow_required"
    POW_INVALID = "pow_invalid"
    NEW_IDENTITY_LIMITED = "new_identity_limited"
    # who may use a key: one live node process per key, a recent enough release
    KEY_IN_USE = "key_in_use"
    NODE_TOO_OLD = "node_too_old"
    # lease
    LEASE_UNKNOWN = "lease_unknown"
    LEASE_NOT_YOURS = "lease_not_yours"
    LEASE_EXPIRED = "lease_expired"
    LEASE_USED = "lease_used"
    # shape and bounds
    WRONG_GROUP_SIZE = "wrong_group_size"
    VERSION_MISMATCH = "version_mismatch"
    TOO_LONG = "too_long"
    TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
    BAD_LOGPROBS = "bad_logprobs"
    PROOF_TOO_LARGE = "proof_too_large"
    BAD_FINISH = "bad_finish"
    DTYPE_NOT_ACCEPTED = "dtype_not_accepted"
    # staleness
    STALE_VERSION = "stale_version"
    # verification (TOPLOC issue)
    TOPLOC_FAILED = "toploc_failed"
    SAMPLING_FAILED = "sampling_failed"
    LOGPROB_MISMATCH = "logprob_mismatch"
    # coordinator side
    UNAVAILABLE = "unavailable"
    STORE_UNAVAILABLE = "store_unavailable"
    INTERNAL = "internal"

    @property
    def code(self) -> grpc.StatusCode:
        return _CODES[self]

    @property
    def strike(self) -> bool:
        return self in _STRIKES

    @property
    def message(self) -> str:
        return _MESSAGES[self]


def parse_reason(text: str) -> Reason | None:
    """The reason spelled ``text`` on the wire, or None: a code this release does not know (a newer
    coordinator's) or a failed call that carried no reason (a gRPC status name in lower case)."""
    try:
        return Reason(text)
    except ValueError:
        return None


_C = grpc.StatusCode
_CODES = {
    Reason.UNSIGNED: _C.UNAUTHENTICATED,
    Reason.BAD_SIGNATURE: _C.UNAUTHENTICATED,
    Reason.UNKNOWN_KEY: _C.UNAUTHENTICATED,
    Reason.BAD_KEY: _C.UNAUTHENTICATED,
    Reason.CLOCK_SKEW: _C.UNAUTHENTICATED,
    Reason.REPLAYED_NONCE: _C.UNAUTHENTICATED,
    Reason.BANNED: _C.PERMISSION_DENIED,
    Reason.RATE_LIMITED: _C.RESOURCE_EXHAUSTED,
    Reason.MESSAGE_TOO_LARGE: _C.RESOURCE_EXHAUSTED,
    Reason.MALFORMED: _C.INVALID_ARGUMENT,
    Reason.DEADLINE_REQUIRED: _C.INVALID_ARGUMENT,
    Reason.POW_REQUIRED: _C.FAILED_PRECONDITION,
    Reason.POW_INVALID: _C.INVALID_ARGUMENT,
    Reason.NEW_IDENTITY_LIMITED: _C.RESOURCE_EXHAUSTED,
    # Neither is retried by a node: waiting does not stop the other process or upgrade this one.
    Reason.KEY_IN_USE: _C.FAILED_PRECONDITION,
    Reason.NODE_TOO_OLD: _C.FAILED_PRECONDITION,
    Reason.LEASE_UNKNOWN: _C.NOT_FOUND,
    Reason.LEASE_NOT_YOURS: _C.PERMISSION_DENIED,
    Reason.LEASE_EXPIRED: _C.FAILED_PRECONDITION,
    Reason.LEASE_USED: _C.ALREADY_EXISTS,
    Reason.WRONG_GROUP_SIZE: _C.INVALID_ARGUMENT,
    Reason.VERSION_MISMATCH: _C.INVALID_ARGUMENT,
    Reason.TOO_LONG: _C.INVALID_ARGUMENT,
    Reason.TOKEN_OUT_OF_VOCAB: _C.INVALID_ARGUMENT,
    Reason.BAD_LOGPROBS: _C.INVALID_ARGUMENT,
    Reason.PROOF_TOO_LARGE: _C.INVALID_ARGUMENT,
    Reason.BAD_FINISH: _C.INVALID_ARGUMENT,
    Reason.DTYPE_NOT_ACCEPTED: _C.FAILED_PRECONDITION,
    Reason.STALE_VERSION: _C.FAILED_PRECONDITION,
    Reason.TOPLOC_FAILED: _C.PERMISSION_DENIED,
    Reason.SAMPLING_FAILED: _C.PERMISSION_DENIED,
    Reason.LOGPROB_MISMATCH: _C.PERMISSION_DENIED,
    Reason.UNAVAILABLE: _C.UNAVAILABLE,
    # A node retries UNAVAILABLE with its backoff (0.5 s doubling to 30 s): a database restart is ridden out.
    Reason.STORE_UNAVAILABLE: _C.UNAVAILABLE,
    Reason.INTERNAL: _C.INTERNAL,
}

_STRIKES = frozenset({
    Reason.LEASE_NOT_YOURS,
    Reason.LEASE_USED,
    Reason.WRONG_GROUP_SIZE,
    Reason.VERSION_MISMATCH,
    Reason.TOO_LONG,
    Reason.TOKEN_OUT_OF_VOCAB,
    Reason.BAD_LOGPROBS,
    Reason.PROOF_TOO_LARGE,
    Reason.BAD_FINISH,
    Reason.TOPLOC_FAILED,
    Reason.SAMPLING_FAILED,
    Reason.LOGPROB_MISMATCH,
})

_MESSAGES = {
    Reason.UNSIGNED: "the request carries no signature; sign it with your node key",
    Reason.BAD_SIGNATURE: "the signature does not match the request body and method",
    Reason.UNKNOWN_KEY: "this key is not registered; call Register first",
    Reason.BAD_KEY: ("the public key is not a usable Ed25519 key (small-order or non-canonical encoding); "
                     "create a new key with `veriroll keygen`"),
    Reason.CLOCK_SKEW: "the request timestamp is outside the accepted window; check your system clock (NTP)",
    Reason.REPLAYED_NONCE: "this nonce was already used; every request needs a fresh nonce",
    Reason.BANNED: ("this key is banned (by the coordinator's operator, or after repeated failed checks); "
                    "`veriroll node credits` shows why and its ledger"),
    Reason.RATE_LIMITED: "too many requests; slow down and retry later",
    Reason.MESSAGE_TOO_LARGE: "the request is larger than the coordinator accepts",
    Reason.MALFORMED: "the request body is not a valid message",
    Reason.DEADLINE_REQUIRED: "every call must carry a deadline (timeout)",
    Reason.POW_REQUIRED: "a new key must carry a proof of work on Register; the detail says how many bits",
    Reason.POW_INVALID: ("the proof of work does not reach its bits for this key, this coordinator and this "
                         "request's timestamp"),
    Reason.NEW_IDENTITY_LIMITED: ("too many new keys registered from this address or its network in the last "
                                  "hour; retry later, or keep using an existing key"),
    Reason.KEY_IN_USE: ("another node process is running with this key; stop it, or give this node its own key "
                        "(`veriroll keygen --out OTHER.key`)"),
    Reason.NODE_TOO_OLD: "this node's release is older than the coordinator accepts; upgrade: pip install -U veriroll",
    Reason.LEASE_UNKNOWN: "no such lease",
    Reason.LEASE_NOT_YOURS: "this lease was issued to another node",
    Reason.LEASE_EXPIRED: "the lease deadline has passed; its prompt went back to the pool",
    Reason.LEASE_USED: "this lease was already submitted with different content",
    Reason.WRONG_GROUP_SIZE: "a group must contain exactly the leased number of samples",
    Reason.VERSION_MISMATCH: "the group was generated with another policy version than the lease names",
    Reason.TOO_LONG: "a sample is empty or longer than the lease allows",
    Reason.TOKEN_OUT_OF_VOCAB: "a token id is outside the model vocabulary",
    Reason.BAD_LOGPROBS: "log-probs must be finite, <= 0 and one per token",
    Reason.PROOF_TOO_LARGE: "a proof is larger than its token count allows",
    Reason.BAD_FINISH: "finish reason does not match the tokens (stop token or max length)",
    Reason.DTYPE_NOT_ACCEPTED: "this coordinator does not verify groups generated in that precision; set the node's dtype",
    Reason.STALE_VERSION: "the policy version is too old; fetch the newest weights",
    Reason.TOPLOC_FAILED: "the activation commitment does not match the trusted model",
    Reason.SAMPLING_FAILED: "the tokens are not the seeded draw from the trusted logits",
    Reason.LOGPROB_MISMATCH: "the claimed log-probs differ from the trusted ones",
    Reason.UNAVAILABLE: "the coordinator is busy; retry later",
    Reason.STORE_UNAVAILABLE: ("the coordinator cannot reach its database right now (restarting?); retry in a few "
                               "seconds (a group submitted again is answered as the first time)"),
    Reason.INTERNAL: "the coordinator failed to process the request; it was not accepted",
}

assert set(_CODES) == set(Reason) == set(_MESSAGES)
