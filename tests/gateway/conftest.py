import pytest
import pytest_asyncio

from gateway.tokenizer import Tokenizer
from specd.model_store import DEFAULT_MODEL
from specd.types import SpeculativeConfig

# No drafter services run in these tests, so the target serves method "none" only.
NO_SPECULATION = SpeculativeConfig(method="none")
# Small enough that a request for the whole context cannot be admitted (RESOURCE_EXHAUSTED).
TARGET_KV_CACHE_TOKENS = 2048


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The real SmolLM2 tokenizer (byte-level BPE), loaded once."""
    return Tokenizer.load(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def no_speculation() -> SpeculativeConfig:
    return NO_SPECULATION


@pytest.fixture(scope="session")
def make_target():
    """Builds a real target service with the real model, not started; the caller starts and stops it."""
    from target_svc.server import TargetOptions, TargetService  # here: the unit tests need no torch

    return lambda: TargetService(TargetOptions(model=DEFAULT_MODEL, address="127.0.0.1:0", metrics_address=None,
                                               default_speculative=NO_SPECULATION,
                                               kv_cache_tokens=TARGET_KV_CACHE_TOKENS))


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def target(make_target):
    """One running target for the tests of this package that need it."""
    service = make_target()
    await service.start()
    yield service
    await service.stop(grace=0)
