"""Settings of the bundled engine (every role: unified, prefill, decode).

Built once in the role's ``main()`` from ``KVGUARD_*`` environment variables and command-line
overrides; nothing reads the environment anywhere else in ``backend/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from contracts.settings import KvguardSettings, require_real_secret

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled" / "kvguard-tiny"
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", "[::]", "*"})


class BackendSettings(KvguardSettings):
    host: str = Field(default="127.0.0.1", description="address the engine listens on")
    port: int = Field(default=8100, ge=1, le=65535, description="port the engine listens on")
    model: Path = Field(
        default=BUNDLED_MODEL_DIR,
        description="checkpoint directory (HF layout), or a Hugging Face cache entry "
        "(models--org--name, or one of its snapshots/<hash>)",
    )
    served_model_name: str | None = Field(
        default=None,
        description="model id in the API; default: org/name for a cache entry, else the "
        "checkpoint dir's name",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="compute and KV dtype; auto: float32 on CPU, the checkpoint's dtype on GPU",
    )
    page_size: int = Field(default=16, ge=1, le=4096, description="tokens per KV page")
    pool_tokens: int | None = Field(
        default=None, ge=1, description="KV pool size in tokens (wins over kv_memory_bytes)"
    )
    kv_memory_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="memory budget for the KV pool when pool_tokens is unset",
    )
    context_window: int | None = Field(
        default=None, ge=1, description="advertised window; default: the model's, capped by pool"
    )
    allow_capacity_drift: bool = Field(
        default=False, description="start even if the window exceeds the real pool (reported)"
    )
    zero_on_free: bool = Field(
        default=True, description="zero a freed KV page before it can be allocated again"
    )
    prefix_cache: bool = Field(
        default=True,
        description="reuse the K/V of full prompt pages across requests of one tenant, namespaced "
        "per tenant (a server-side salt; never a request field); off: every prompt is computed. "
        "The decode role has none (its prompts' K/V comes from prefill)",
    )
    prefix_cache_groups: dict[str, list[str]] = Field(
        default_factory=dict,
        description="tenants that share one prefix-cache namespace, {group: [tenant ids]}: they "
        "share hits, and each can then learn from timing whether another sent a prefix",
    )
    kv_allocation: Literal["on_demand", "reserve"] = Field(
        default="on_demand",
        description="on_demand: pages as tokens are computed, preempting (recompute) when the "
        "pool runs out; reserve: every page for prompt + max_tokens at admission, never preempts",
    )
    max_batch_tokens: int = Field(default=2048, ge=1, description="tokens per forward step")
    max_running: int = Field(default=64, ge=1, description="sequences decoding at once")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        default="auto",
        description=(
            "paged attention: torch (CPU reference), triton (GPU kernel), auto (triton on CUDA, "
            "else torch)"
        ),
    )
    device: str = Field(
        default="cpu", description="torch device of the model and KV pool (cpu, cuda, cuda:1, ...)"
    )
    torch_threads: int | None = Field(
        default=None, ge=1, description="CPU threads torch may use (unset: torch's default)"
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="largest request body accepted (413 beyond)"
    )
    header_timeout_s: float = Field(
        default=15.0, gt=0, description="a client must send its whole request head within this"
    )
    body_timeout_s: float = Field(
        default=60.0, gt=0, description="a client must send its whole request body within this"
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="the longest one request may run before it is aborted and its pages released",
    )
    otlp_endpoint: str | None = Field(
        default=None, description="OTLP/HTTP collector for the engine's spans (unset: no spans)"
    )

    engine_token: SecretStr | None = Field(
        default=None,
        description="the deployment's engine credential: every route but /health and /metrics "
        "takes it as a bearer token (the gateway and decode present it); required in production, "
        "unset in development means open",
    )
    decode_peers: list[str] | None = Field(
        default=None,
        description="prefill: the hosts (or host:port) of the decode peers it may write KV to; "
        "it writes only to the exact transfer targets such a decode announced (others are "
        "refused); unset: loopback hosts only; required in production",
    )

    # -- disaggregation: the prefill and decode roles (backend.disagg) ------------------------
    prefill_url: str | None = Field(default=None, description="decode: the prefill role's URL")
    transport: Literal["mooncake", "loopback", "inprocess"] = Field(
        default="mooncake",
        description="KV transport: mooncake; loopback (TCP on 127.0.0.1, single host, when "
        "Mooncake is not installed); inprocess (both roles in one process: tests)",
    )
    kv_channel: Literal["sealed", "open"] = Field(
        default="sealed",
        description="how KV crosses the transfer port: sealed (each handoff lands in slots "
        "registered for it alone, every page sealed with AES-256-GCM under a key only its ticket "
        "carries, moved into the pool after every check); open (decode's KV pools registered for "
        "the process's life, plaintext written into them: any peer of the transfer port reads "
        "and writes live KV; development and benchmarks only, production refuses it)",
    )
    transfer_bind: str | None = Field(
        default=None,
        description="address the KV transfer port listens on; unset: the address the role "
        "serves on (host). Mooncake listens on every interface whatever is set: production then "
        "requires 0.0.0.0 here (asked for), development warns",
    )
    transfer_host: str | None = Field(
        default=None,
        description="address peers write KV to (the host of the announced transfer endpoint); "
        "unset: transfer_bind, or 127.0.0.1 when that is a wildcard",
    )
    transfer_protocol: Literal["tcp", "rdma"] = Field(
        default="tcp",
        description="Mooncake transport between prefill and decode: tcp, or rdma on clusters",
    )
    transfer_device: str = Field(default="", description="RDMA device names, empty for TCP")
    transfer_batch_pages: int = Field(
        default=16, ge=1, description="decode: most pages prefill may have in flight at once"
    )
    transfer_min_bytes_per_s: float = Field(
        default=50e6, gt=0, description="decode: transfer bandwidth floor the drain bound assumes"
    )
    drain_slack_s: float = Field(default=0.5, ge=0, description="one control-message delay")
    handoff_timeout_s: float = Field(
        default=30.0, gt=0, description="lease: decode waits this long, prefill writes no later"
    )
    abort_ack_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "decode: how long to wait for prefill to confirm an abort before the drain bound "
            "decides"
        ),
    )
    prefill_capacity_refresh_s: float = Field(
        default=1.0, gt=0, description="decode: how often it reads prefill's /engine/capacity"
    )
    prefill_capacity_stale_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "decode: prefill's capacity older than this is unknown (requests refused, fail closed)"
        ),
    )
    staging_pages: int | None = Field(
        default=None, ge=1, description="prefill: transfer staging pages (default: pool pages)"
    )
    kv_checksum: Literal["crc32", "sha256"] = Field(
        default="crc32", description="prefill: checksum of the transferred KV (decode recomputes)"
    )
    allow_fault_drills: bool = Field(
        default=False,
        description=(
            "accept KVGUARD_FAULTS / --fault (drills remove isolation defences; refused otherwise)"
        ),
    )
    faults: list[str] = Field(default_factory=list, description="fault drills to enable")
    drill_link_bytes_per_s: float | None = Field(
        default=None, gt=0, description="drill: prefill simulates a slow link of this bandwidth"
    )
    drill_protocol_version: int | None = Field(
        default=None, ge=0, description="drill: speak another handoff protocol version"
    )

    @model_validator(mode="after")
    def _check_model_dir(self) -> BackendSettings:
        if not self.model.is_dir():
            raise ValueError(f"model directory {self.model} does not exist")
        drills = {
            "drill_link_bytes_per_s": self.drill_link_bytes_per_s,
            "drill_protocol_version": self.drill_protocol_version,
        }
        used = [name for name, value in drills.items() if value is not None]
        if used and not self.allow_fault_drills:
            raise ValueError(f"{', '.join(used)} need allow_fault_drills (--allow-fault-drills)")
        bind = self.transfer_bind_address
        if self.transport == "loopback" and self.transfer_host not in (None, bind):
            raise ValueError(
                "the loopback transport's endpoint is its bind address: leave transfer_host "
                f"unset or equal to {bind}"
            )
        members = [t for tenants in self.prefix_cache_groups.values() for t in tenants]
        if len(members) != len(set(members)):
            raise ValueError("prefix_cache_groups: a tenant is in more than one group")
        if self.prefill_capacity_stale_s < self.prefill_capacity_refresh_s:
            raise ValueError("prefill_capacity_stale_s must be >= prefill_capacity_refresh_s")
        require_real_secret("engine_token", self.engine_token, "", self.mode)
        return self

    @property
    def transfer_bind_address(self) -> str:
        """Where the transfer port listens: ``transfer_bind``, else the role's own ``host``."""
        return self.transfer_bind or self.host

    @property
    def transfer_endpoint_host(self) -> str:
        """The host peers reach the transfer port by (the announced endpoint's)."""
        if self.transfer_host:
            return self.transfer_host
        bind = self.transfer_bind_address
        return "127.0.0.1" if bind in WILDCARD_ADDRESSES else bind

    def engine_headers(self) -> dict[str, str]:
        """What this engine presents to its peer role (decode -> prefill)."""
        if self.engine_token is None:
            return {}
        return {"Authorization": f"Bearer {self.engine_token.get_secret_value()}"}
