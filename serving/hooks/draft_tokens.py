"""Per-request draft tokens for the scheduler's grammar check (patch mtp-03).

vLLM 0.33.0's ``DraftTokensHandler`` keeps only the last sampled batch's draft tokens. Under
pipeline parallelism the V2 runner decodes each request every ``pp_size`` steps, so two requests
alternate batches, and when the scheduler asks for the draft tokens of the request it is building
a grammar bitmask for, it gets ``-1`` instead. It then applies the pre-draft grammar state at the
bonus position while the GPU verifies the real draft, and ``accept_tokens`` rejects the pair: the
HTTP 500 of seed 000 §8 (9 of 16 structured requests at 2 concurrent). Keeping the latest real
drafts of every live request, and returning them all, makes the scheduler see what the GPU will
verify next.
"""

from __future__ import annotations

from flashnext import envs


class LatestDraftTokens:
    """The latest real (not placeholder) draft tokens of each live request."""

    def __init__(self) -> None:
        self._latest: dict[str, list[int]] = {}
        self.enabled = envs.VLLM_MTP_DRAFTS_PER_REQUEST.enabled()

    def collect(self, req_ids: list[str], draft_token_ids: list[list[int]]) -> tuple[list[str], list[list[int]]]:
        """Record this batch's drafts; return every live request's latest (this batch's first)."""
        if not self.enabled:
            return req_ids, draft_token_ids
        for req_id, drafts in zip(req_ids, draft_token_ids):
            if any(t >= 0 for t in drafts):
                self._latest[req_id] = list(drafts)
        out_ids = list(req_ids)
        out_tokens = [self._latest.get(r, d) for r, d in zip(req_ids, draft_token_ids)]
        seen = set(req_ids)
        for req_id, drafts in self._latest.items():
            if req_id not in seen:
                out_ids.append(req_id)
                out_tokens.append(drafts)
        return out_ids, out_tokens

    def drop(self, req_ids) -> None:
        """Forget finished or preempted requests."""
        for req_id in req_ids:
            self._latest.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._latest)
