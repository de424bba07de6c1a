"""What the control plane stores, and its JSON form. Pure: no redis import, tested in ms.

The operator's settings (`PoolSLO`, `ReplicaBounds`, pins) and the autoscaler's decisions
(`DecisionRecord`) are defined here; a replica's status is the `ReplicaLoad` it reports
(engine/messages.py), stored as is.

Each `decode_*` takes the raw value Redis returned (str or bytes) and raises ValueError naming
the field when it is malformed: a bad record written by a buggy or newer writer is an error,
never a silent default. Unknown fields are ignored so a newer writer can add some.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from control.keys import validate_pool
from engine.messages import ReplicaLoad
from prefill_workers.replica import pool_of


@dataclass(frozen=True)
class PoolSLO:
    """Latency targets, both on the P95 of the recent window."""

    ttft_p95_s: float = 5.0
    tpot_p95_s: float = 0.2

    def __post_init__(self) -> None:
        if self.ttft_p95_s <= 0:
            raise ValueError(f"ttft_p95_s must be > 0, got {self.ttft_p95_s}")
        if self.tpot_p95_s <= 0:
            raise ValueError(f"tpot_p95_s must be > 0, got {self.tpot_p95_s}")


@dataclass(frozen=True)
class ReplicaBounds:
    """The replica range a pool may take; a pin outside it is clamped into it."""

    min_replicas: int = 1
    max_replicas: int = 64

    def __post_init__(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {self.min_replicas}")
        if self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(
                f"max_replicas must be >= max(min_replicas, 1), got {self.max_replicas} "
                f"with min_replicas {self.min_replicas}"
            )

    def clamp(self, num_replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, num_replicas))


@dataclass(frozen=True)
class DecisionRecord:
    """One autoscaling decision, as `pdserve status` shows it; `at` is unix seconds."""

    at: float
    pool: str
    current_replicas: int
    target_replicas: int
    reason: str
    # The signals the decision read (p95s, queue wait, KV usage...), for the operator.
    inputs: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_timestamp("at", self.at)
        validate_pool(self.pool)
        for name in ("current_replicas", "target_replicas"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        # A private copy: the record is frozen, so the caller's dict must not change it later.
        object.__setattr__(self, "inputs", {str(k): float(v) for k, v in self.inputs.items()})


@dataclass(frozen=True)
class RoleTable:
    """Which pool's calls each KV-pool replica takes: its own pool's, except those flipped
    (`flipped`: worker id -> the pool whose calls it takes now). `version` counts the flips."""

    version: int = 0
    flipped: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version < 0:
            raise ValueError(f"roles version must be >= 0, got {self.version}")
        for worker_id, role in self.flipped.items():
            validate_pool(role)
            validate_pool(pool_of(worker_id))

    def role_of(self, worker_id: str) -> str:
        """The pool whose calls `worker_id` takes now."""
        return self.flipped.get(worker_id, pool_of(worker_id))


@dataclass(frozen=True)
class RolesApplied:
    """A router's acknowledgement: the roles version it routes by, and when it said so."""

    version: int
    at: float


def encode_roles_applied(applied: RolesApplied) -> str:
    return f"{applied.version} {applied.at!r}"


def decode_roles_applied(raw: str | bytes) -> RolesApplied:
    text = raw.decode() if isinstance(raw, bytes) else raw
    try:
        version, at = text.split()
        return RolesApplied(int(version), float(at))
    except ValueError:
        raise ValueError(f"roles applied must be 'version unix-seconds', got {text!r}") from None


def _check_timestamp(name: str, value: float) -> None:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite unix time >= 0, got {value}")


def _dumps(data: dict[str, object]) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def encode_replica_load(load: ReplicaLoad) -> str:
    validate_pool(load.pool)
    return _dumps(asdict(load))


def decode_replica_load(raw: str | bytes) -> ReplicaLoad:
    data = _load_object(raw, "replica load")
    return ReplicaLoad(
        replica_id=_str(data, "replica_id"),
        pool=validate_pool(_str(data, "pool")),
        num_pending_prefill_tokens=_int(data, "num_pending_prefill_tokens"),
        num_running=_int(data, "num_running"),
        num_waiting=_int(data, "num_waiting"),
        kv_usage=_float(data, "kv_usage"),
        num_total_blocks=_int(data, "num_total_blocks"),
        num_free_blocks=_int(data, "num_free_blocks"),
        updated_at=_float(data, "updated_at"),
        num_kv_loads=_int(data, "num_kv_loads"),
        num_kv_load_failures=_int(data, "num_kv_load_failures"),
        num_kv_recomputed_tokens=_int(data, "num_kv_recomputed_tokens"),
        # Absent from loads written before the field existed: healthy, as they were then.
        is_healthy=_bool(data, "is_healthy") if "is_healthy" in data else True,
    )


def encode_decision(record: DecisionRecord) -> str:
    return _dumps(asdict(record))


def decode_decision(raw: str | bytes) -> DecisionRecord:
    data = _load_object(raw, "decision record")
    inputs = data.get("inputs", {})
    if not isinstance(inputs, dict):
        raise ValueError(f"decision record: 'inputs' must be an object, got {inputs!r}")
    return DecisionRecord(
        at=_float(data, "at"),
        pool=_str(data, "pool"),
        current_replicas=_int(data, "current_replicas"),
        target_replicas=_int(data, "target_replicas"),
        reason=_str(data, "reason"),
        inputs={name: _float(inputs, name) for name in inputs},
    )


def encode_slo(slo: PoolSLO) -> str:
    return _dumps(asdict(slo))


def decode_slo(raw: str | bytes) -> PoolSLO:
    data = _load_object(raw, "SLO")
    return PoolSLO(ttft_p95_s=_float(data, "ttft_p95_s"), tpot_p95_s=_float(data, "tpot_p95_s"))


def encode_bounds(bounds: ReplicaBounds) -> str:
    return _dumps(asdict(bounds))


def decode_bounds(raw: str | bytes) -> ReplicaBounds:
    data = _load_object(raw, "replica bounds")
    return ReplicaBounds(
        min_replicas=_int(data, "min_replicas"), max_replicas=_int(data, "max_replicas")
    )


def encode_pin(num_replicas: int) -> str:
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 0:
        raise ValueError(f"a pin must be an int >= 0, got {num_replicas!r}")
    return str(num_replicas)


def decode_pin(raw: str | bytes) -> int:
    text = raw.decode() if isinstance(raw, bytes) else raw
    # int() alone would also take " 4", "+4" and "4_0"; a pin is written by encode_pin only.
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"pin: expected a replica count, got {text!r}")
    return int(text)


def _load_object(raw: str | bytes, what: str) -> dict[str, object]:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{what}: not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _require(data: dict[str, object], name: str) -> object:
    if name not in data:
        raise ValueError(f"missing field {name!r}")
    return data[name]


def _str(data: dict[str, object], name: str) -> str:
    value = _require(data, name)
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {value!r}")
    return value


def _int(data: dict[str, object], name: str) -> int:
    value = _require(data, name)
    # bool is an int subclass; `true` for a count is a writer bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"field {name!r} must be an integer, got {value!r}")
    return value


def _bool(data: dict[str, object], name: str) -> bool:
    value = _require(data, name)
    if not isinstance(value, bool):
        raise ValueError(f"field {name!r} must be true or false, got {value!r}")
    return value


def _float(data: dict[str, object], name: str) -> float:
    value = _require(data, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"field {name!r} must be a number, got {value!r}")
    return float(value)
