"""Engines that can be one worker or a deployment of workers behind a router (SGLang, vLLM).

Lifecycle of one introspection:

1. workers: the spec's members (each with its own role, URL, key and optional declared pool), or
   the engine itself when it has none; with ``discover_members``, the router's own worker list
   too: a worker it routes to that is not a member fails the engine closed (its pool would be
   unmeasured), and with no members the listed workers are the members;
2. each worker is read concurrently with the kind's own endpoints (``read_worker``); any failure
   fails the whole engine with a reason naming the member (fail closed: a request could land on
   the worker nobody measured);
3. every worker must serve the same model (and the configured one, if set);
4. an engine registered alone (no members) that is a router by its own account is refused with
   the fix (``router_problem``: the SGLang model gateway answers ``GET /workers``; it shows its
   first worker's info only), as is a worker that cannot be a whole serving path alone
   (``standalone_problem``);
5. the counting target is probed on the first prefill/unified worker with what admission will
   send it, a chat (routers do not count chat prompts: the SGLang model gateway's /v1/tokenize
   takes a prompt string only, mini_lb and the vLLM PD proxy serve no tokenize route at all); a
   worker whose release counts prompt strings only (``chat_refusal``) is probed with a prompt
   and its target refuses chats with that reason;
6. ``group_snapshot`` joins the workers into one path whose limit is the smallest pool.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from dataclasses import dataclass, replace

import httpx

from gateway.engines.adapters.base import AdapterError, EngineAdapter, probe_tokenize
from gateway.engines.capacity import (
    CacheIsolation,
    CapacitySnapshot,
    TokenizeTarget,
    group_snapshot,
)
from gateway.engines.spec import MemberRole, MemberSpec

# What the probe asks to count: a chat, as admission sends one (or a prompt, where chats cannot be
# counted); each kind's tokenize_request turns it into that kind's body.
PROBE_CHAT = {"messages": [{"role": "user", "content": "kvguard"}]}
PROBE_PROMPT = {"prompt": "kvguard"}


@dataclass(frozen=True, slots=True)
class Worker:
    """One worker to read: the engine itself (member None) or one member of its group."""

    url: str
    headers: dict[str, str]
    declared_pool_tokens: int | None
    member: MemberSpec | None = None

    @property
    def counts(self) -> bool:
        return self.member is None or self.member.role is not MemberRole.DECODE


class GroupAdapter(EngineAdapter):
    tokenize_paths: tuple[str, ...] = ("/tokenize",)

    @abstractmethod
    async def read_worker(
        self, client: httpx.AsyncClient, worker: Worker, *, timeout: float
    ) -> CapacitySnapshot:
        """One worker's capacity, read from its own endpoints."""

    def standalone_problem(self, snapshot: CapacitySnapshot) -> str | None:
        """Why a worker registered alone (no members) cannot be a whole serving path, if so."""
        return None

    async def router_problem(self, client: httpx.AsyncClient, *, timeout: float) -> str | None:
        """Why an engine registered alone is a router to register as a group, if it says so."""
        return None

    def chat_refusal(self, snapshot: CapacitySnapshot) -> str | None:
        """Why this worker's tokenize route cannot count a chat (its release), if so."""
        return None

    async def listed_workers(
        self, client: httpx.AsyncClient, *, timeout: float
    ) -> list[tuple[str, MemberRole]]:
        """(URL, role) of every worker the router routes to, from the router itself."""
        raise AdapterError(f"{self.spec.kind.value}: no router worker list is known")

    async def router_drops_salt(self, client: httpx.AsyncClient, *, timeout: float) -> str | None:
        """Why the router in front of the members does not pass the isolation field on, if so
        (the members' own isolation then does not hold for requests sent through it)."""
        return None

    async def introspect(self, client: httpx.AsyncClient, *, timeout: float) -> CapacitySnapshot:
        workers = self.workers()
        if self.spec.discover_members:
            listed = await self.listed_workers(client, timeout=timeout)
            workers = reconcile(workers, listed, headers=self.headers())
        parts = await asyncio.gather(
            *(self._read(client, worker, timeout=timeout) for worker in workers)
        )
        model = self.check_model(parts[0].model)
        for worker, part in zip(workers, parts, strict=True):
            if part.model != model:
                raise AdapterError(
                    f"member '{_name(worker)}' serves model '{part.model}', the group '{model}'"
                )
        if workers[0].member is None:  # registered alone
            snapshot = parts[0]
            problem = await self.router_problem(client, timeout=timeout)
            problem = problem or self.standalone_problem(snapshot)
            if problem is not None:
                return _with(snapshot, tokenize=None, unavailable=problem)
            target = await self._probe(client, workers[0], snapshot, model=model, timeout=timeout)
            return _with(snapshot, tokenize=target, unavailable=snapshot.unavailable)
        counter, part = next((w, p) for w, p in zip(workers, parts, strict=True) if w.counts)
        target = await self._probe(client, counter, part, model=model, timeout=timeout)
        named = [(_name(worker), part) for worker, part in zip(workers, parts, strict=True)]
        snapshot = group_snapshot(model, named, tokenize=target)
        dropped = await self.router_drops_salt(client, timeout=timeout)
        if dropped is not None and snapshot.isolation and snapshot.isolation.field is not None:
            return replace(snapshot, isolation=CacheIsolation(field=None, detail=dropped))
        return snapshot

    def workers(self) -> list[Worker]:
        if not self.spec.members:
            return [
                Worker(
                    url=self.spec.base_url,
                    headers=self.headers(),
                    declared_pool_tokens=self.spec.declared_pool_tokens,
                )
            ]
        return [
            Worker(
                url=member.url,
                headers=self.headers(member=member.name),
                declared_pool_tokens=member.declared_pool_tokens,
                member=member,
            )
            for member in self.spec.members
        ]

    async def _read(
        self, client: httpx.AsyncClient, worker: Worker, *, timeout: float
    ) -> CapacitySnapshot:
        if worker.member is None:
            return await self.read_worker(client, worker, timeout=timeout)
        try:
            return await self.read_worker(client, worker, timeout=timeout)
        except AdapterError as exc:
            member = worker.member
            raise AdapterError(
                f"member '{member.name}' ({member.role.value}, {member.url}): {exc}"
            ) from exc

    async def _probe(
        self,
        client: httpx.AsyncClient,
        worker: Worker,
        snapshot: CapacitySnapshot,
        *,
        model: str,
        timeout: float,
    ) -> TokenizeTarget:
        refusal = self.chat_refusal(snapshot)
        if refusal is not None and worker.member is not None:
            refusal = f"member '{worker.member.name}': {refusal}"
        request = self.tokenize_request(model, PROBE_CHAT if refusal is None else PROBE_PROMPT)
        try:
            url = await probe_tokenize(
                client,
                worker.url,
                self.tokenize_paths,
                request=request,
                timeout=timeout,
                headers=worker.headers,
            )
        except AdapterError as exc:
            if worker.member is None:
                raise AdapterError(
                    f"{exc}: a router that counts no chat prompts needs the deployment "
                    "registered as a group (register its workers as members)"
                ) from exc
            raise AdapterError(f"member '{worker.member.name}': {exc}") from exc
        member = None if worker.member is None else worker.member.name
        return TokenizeTarget(url=url, member=member, chat_refused=refusal)


def reconcile(
    workers: list[Worker], listed: list[tuple[str, MemberRole]], *, headers: dict[str, str]
) -> list[Worker]:
    """The workers to read, given the router's list: a listed worker must be a member."""
    if not listed:
        raise AdapterError("the router lists no worker")
    known = {_base(w.url) for w in workers if w.member is not None}
    if not known:
        return [
            Worker(
                url=url,
                headers=headers,
                declared_pool_tokens=None,
                member=MemberSpec(name=f"{role.value}-{index}", role=role, url=url),
            )
            for index, (url, role) in enumerate(listed)
        ]
    for url, role in listed:
        if _base(url) not in known:
            raise AdapterError(
                f"the router routes to {role.value} worker {url}, which is not a member: add it "
                "to members (its pool is not measured)"
            )
    return workers


def _base(url: str) -> str:
    """A worker URL without a data-parallel rank suffix (the model gateway's ``url@rank``)."""
    return url.rstrip("/").split("@")[0].rstrip("/")


def _name(worker: Worker) -> str:
    return "engine" if worker.member is None else worker.member.name


def _with(
    snapshot: CapacitySnapshot, *, tokenize: TokenizeTarget | None, unavailable: str | None
) -> CapacitySnapshot:
    return replace(snapshot, tokenize=tokenize, unavailable=unavailable)
