"""External provider fallback: OpenAI and Anthropic behind the dispatcher's ProviderCall."""

from router.providers.client import SERVED_BY_HEADER, ProviderClient

__all__ = ["SERVED_BY_HEADER", "ProviderClient"]
