"""The validated `args:` of a Serve config file (`import_path: serving.app:build_app`).

```yaml
args:
  model_name: tiny          # the id clients pass as `model`; defaults to the checkpoint's name
  num_gangs: 1              # EP groups side by side (each gang = ep_size rank replicas)
  engine: {model: tiny-dsv3, ep_size: 2, ...}   # exactly LLM(...)'s keywords (EngineConfig)
```
Every error names the offending field by its dotted path (`engine.ep_size`, `ingress.num_cpus`),
because a Serve deploy that fails deep inside a replica constructor is hard to trace back to YAML.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.config import EngineConfig


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AutoscalingOptions(_Strict):
    """Autoscaling in whole gangs: Serve rounds replica counts up to multiples of the gang size."""

    min_gangs: int = Field(1, ge=0)
    max_gangs: int = Field(1, ge=1)
    initial_gangs: int | None = Field(None, ge=0)
    # Ongoing requests per rank replica that Serve's policy aims for.
    target_ongoing_requests: float = Field(32.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> AutoscalingOptions:
        if self.min_gangs > self.max_gangs:
            raise ValueError("min_gangs must be <= max_gangs")
        if (
            self.initial_gangs is not None
            and not self.min_gangs <= self.initial_gangs <= self.max_gangs
        ):
            raise ValueError("initial_gangs must lie in [min_gangs, max_gangs]")
        return self


class IngressOptions(_Strict):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    # In-flight requests one ingress replica admits; beyond it clients get 429 + Retry-After at
    # once instead of queueing invisibly in the proxy.
    max_concurrent_requests: int = Field(256, ge=1)


class RouterOptions(_Strict):
    """Knobs of `serving.router.LoadPrefixRequestRouter` (see its docstring for the policy)."""

    prefix_block_tokens: int = Field(16, ge=1, description="prefix hashing granularity")
    prefix_max_tokens: int = Field(
        256, ge=1, description="longest prefix the affinity table tracks"
    )
    # A replica holding the prompt's prefix wins while its outstanding tokens exceed the least
    # loaded replica's by at most this much: re-prefilling a prefix costs about its length.
    affinity_slack_tokens: int = Field(4096, ge=0)
    max_prefix_entries: int = Field(100_000, ge=1)
    stats_period_s: float = Field(1.0, gt=0, description="how often ranks report their load")


class ServingConfig(_Strict):
    engine: EngineConfig = Field(default_factory=EngineConfig)
    model_name: str | None = Field(None, min_length=1)
    num_gangs: int = Field(1, ge=1, description="EP groups when not autoscaling")
    autoscaling: AutoscalingOptions | None = None
    # Requests waiting in each handle's router queue for a rank; beyond it the handle raises
    # BackPressureError and the client gets 503 + Retry-After. -1: unbounded.
    max_queued_requests: int = Field(128, ge=-1)
    # Requests one rank replica accepts at once (Serve's max_ongoing_requests); default leaves
    # room for the engine's own waiting queue beyond its running batch.
    max_ongoing_requests_per_rank: int | None = Field(None, ge=1)
    cpus_per_rank: float = Field(1.0, ge=0)
    gpus_per_rank: float = Field(0.0, ge=0)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    router: RouterOptions = Field(default_factory=RouterOptions)

    @model_validator(mode="after")
    def _check(self) -> ServingConfig:
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests must be -1 (unbounded) or >= 1")
        return self

    @property
    def served_model_name(self) -> str:
        return self.model_name or os.path.basename(os.path.normpath(self.engine.model))

    @property
    def rank_max_ongoing_requests(self) -> int:
        if self.max_ongoing_requests_per_rank is not None:
            return self.max_ongoing_requests_per_rank
        return 2 * self.engine.max_running_requests

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> ServingConfig:
        """Validate Serve `args`; raise ValueError whose lines each name a field's dotted path."""
        try:
            return cls.model_validate(args or {})
        except ValidationError as e:
            raise ValueError("invalid serving config:\n" + format_validation_error(e)) from None


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)
