"""The guarded-tier driver: how the cache and every engine adapter (vLLM, SGLang,
LMCache) call a tier. `GuardedTier` owns the breaker, the in-flight budget, the answer
checks, the backstop behind the tier's own deadline, and the tier's open/reopen/close;
an adapter only translates its engine's calls and crosses threads."""

from tierkv.driver.checks import backstop_after
from tierkv.driver.guarded import Failure, GuardedTier, JobKind, JobOutcome, Refusal

__all__ = ["Failure", "GuardedTier", "JobKind", "JobOutcome", "Refusal", "backstop_after"]
