"""Server settings (address, key, limits), validated once where they come in."""

from __future__ import annotations

import dataclasses

from kvserve.config import parse_bytes
from kvserve.errors import ConfigError
from kvserve.server.sampling_defaults import GENERATION_CONFIG_MODES, resolve_sampling_defaults


@dataclasses.dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless asked: the API has no key by default
    port: int = 8000  # 0 = any free port (the chosen one is printed)
    api_key: str | None = None
    served_model_name: str | None = None  # default: the engine's model name
    max_request_bytes: int | str = "8MiB"
    drain_timeout_s: float = 10.0  # on SIGTERM/SIGINT: how long in-flight requests may finish
    access_log: bool = True
    restart_engine: bool = False  # after an engine failure: a fresh engine in-process, not exit 1
    # what a request's unset sampling fields take (server/sampling_defaults.py)
    generation_config: str = "auto"  # auto: the model's own, else llama.cpp's; none: OpenAI's
    sampling_overrides: dict[str, float | int | None] = dataclasses.field(default_factory=dict)  # per-field flags

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key", "must not be empty (leave it unset to serve without a key)")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name", "must not be empty")
        self.max_request_bytes = parse_bytes("max_request_bytes", self.max_request_bytes)
        if self.max_request_bytes < 1024:
            raise ConfigError("max_request_bytes", f"must be >= 1024 bytes, got {self.max_request_bytes}")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ConfigError("generation_config", f"must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {self.generation_config!r}")
        # range-checked now, before the model loads; the model's own values join at start-up
        resolve_sampling_defaults(self.generation_config, {}, self.sampling_overrides)
        if not self.drain_timeout_s >= 0:
            raise ConfigError("drain_timeout_s", f"must be >= 0 seconds, got {self.drain_timeout_s}")
