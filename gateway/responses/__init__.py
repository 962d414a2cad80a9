"""The Responses API (``/v1/responses``): request models, the per-engine-kind surface, the
translation for engines that serve only chat completions, the passthrough and screening for
engines that serve it, and the tenant's stored responses. See docs/responses.md."""
