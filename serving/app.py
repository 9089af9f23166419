"""`serving.app:build_app`, the Serve application builder named by configs/*.yaml.

Two deployments: `OpenAIIngress` (FastAPI, HTTP) → the EP-rank deployment from `cluster.serve_rank`
(gang-scheduled: each gang is one expert-parallel group of `ep_size` rank replicas). The ingress
calls the ranks through a handle whose request router is `serving.router.LoadPrefixRequestRouter`;
each rank records its own per-rank metrics (`serving.metrics.publish_rank_report`, its report
hook).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from serving.config import ServingConfig

ROUTER_CLASS = "serving.router:LoadPrefixRequestRouter"


def router_config(config: ServingConfig) -> RequestRouterConfig:
    r = config.router
    return RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={
            "prefix_block_tokens": r.prefix_block_tokens,
            "prefix_max_tokens": r.prefix_max_tokens,
            "affinity_slack_tokens": r.affinity_slack_tokens,
            "max_prefix_entries": r.max_prefix_entries,
        },
        request_routing_stats_period_s=r.stats_period_s,
        # A rank busy with a long prefill may answer late; a missed report only means stale load.
        request_routing_stats_timeout_s=max(5.0, 5 * r.stats_period_s),
    )


def rank_options(config: ServingConfig) -> dict[str, Any]:
    """Deployment options of the rank deployment: the cluster layer's gang/resource plan plus the
    serving layer's routing and admission settings."""
    from cluster.serve_rank import rank_deployment_options

    opts = rank_deployment_options(
        config.engine,
        num_gangs=config.num_gangs,
        autoscaling=config.autoscaling.model_dump() if config.autoscaling else None,
        cpus_per_rank=config.cpus_per_rank,
        gpus_per_rank=config.gpus_per_rank,
    )
    opts["request_router_config"] = router_config(config)
    opts["max_ongoing_requests"] = config.rank_max_ongoing_requests
    opts["max_queued_requests"] = config.max_queued_requests
    return opts


def ingress_app(config: ServingConfig, ranks: Application) -> Application:
    """The ingress in front of any rank application (the real one, or a test stand-in)."""
    from serving.ingress import OpenAIIngressDeployment

    ing = config.ingress
    return OpenAIIngressDeployment.options(
        num_replicas=ing.num_replicas,
        ray_actor_options={"num_cpus": ing.num_cpus},
        # Above the admission limit, so excess requests reach the ingress and get a quick 429
        # instead of waiting unseen in the proxy's queue.
        max_ongoing_requests=ing.max_concurrent_requests + 64,
    ).bind(ranks, config)


def build_app(args: dict[str, Any] | None = None) -> Application:
    config = ServingConfig.from_args(args)
    from cluster.serve_rank import build_rank_app
    from serving.metrics import publish_rank_report

    ranks = build_rank_app(config.engine, report_hook=publish_rank_report, **rank_options(config))
    return ingress_app(config, ranks)


__all__ = ["build_app", "ingress_app", "rank_options", "router_config", "serve"]
