"""Per-tenant admission: one client cannot take every engine slot or queue place from the others.

A tenant is the API key a request presents (`--api-key` may be given once per tenant), or, on a server
without keys, the client's address. `TenantLimiter.slot(tenant)` admits at most `concurrency` of one
tenant's requests at a time; up to `queue` more wait their turn in arrival order; beyond that the
request is refused at once with a 429 and `Retry-After` (OpenAI's `rate_limit_exceeded`), before its
body is parsed or tokenised. A slot is held until the response ends (a stream's last byte).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from glm5.serve.common import APIError


@dataclass
class _Tenant:
    slots: asyncio.Semaphore
    admitted: int = 0  # running + waiting for a slot


@dataclass
class TenantLimiter:
    concurrency: int  # requests of one tenant served at once
    queue: int  # more requests of one tenant that may wait for a slot
    retry_after_s: int = 1
    _tenants: dict[str, _Tenant] = field(default_factory=dict)

    def slot(self, tenant: str) -> "_Slot":
        """Admit one request of `tenant` (a 429 `APIError` when its queue is full); `async with` the result
        waits for one of the tenant's slots and holds it."""
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(asyncio.Semaphore(self.concurrency))
        if t.admitted >= self.concurrency + self.queue:
            raise APIError(429, f"too many requests at once from this client: {self.concurrency} running and "
                                f"{self.queue} waiting is the limit per API key; retry after the others end",
                           "requests", code="rate_limit_exceeded",  # OpenAI's type for a request-rate limit
                           headers={"Retry-After": str(self.retry_after_s)})
        t.admitted += 1
        return _Slot(self, tenant, t)

    def _leave(self, tenant: str, t: _Tenant) -> None:
        t.admitted -= 1
        if t.admitted == 0:  # idle tenants cost nothing
            del self._tenants[tenant]

    def admitted(self, tenant: str) -> int:
        """Requests of `tenant` running or waiting now."""
        t = self._tenants.get(tenant)
        return 0 if t is None else t.admitted


@dataclass
class _Slot:
    limiter: TenantLimiter
    tenant: str
    t: _Tenant

    async def __aenter__(self) -> None:
        try:
            await self.t.slots.acquire()
        except BaseException:  # cancelled while waiting (the client went away): leave the queue
            self.limiter._leave(self.tenant, self.t)
            raise

    async def __aexit__(self, *exc) -> None:
        self.t.slots.release()
        self.limiter._leave(self.tenant, self.t)
