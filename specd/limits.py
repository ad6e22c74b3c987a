"""The size bounds of every specd API, in one place: no field lets one client make a service do
unbounded work or hold unbounded memory. A request over a bound gets INVALID_ARGUMENT naming it."""

# Public API (gateway) and target.
MAX_HTTP_BODY_BYTES = 16 * 1024 * 1024  # the HTTP API's request bodies, as gRPC's message bound
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_CHAT_MESSAGES = 4096
MAX_CORPUS_SCOPE_CHARS = 64  # SpeculativeConfig.corpus_scope (a tenant's name, a hash of its key)

# Drafter API. The target never sends past these: a longer sequence goes draft-free, and a step
# whose sync would exceed MAX_PROPOSE_TOKENS leaves some sequences out until the next step.
MAX_SEQUENCE_ID_CHARS = 64
MAX_PROPOSE_SEQUENCES = 1024
MAX_DRAFTER_SEQUENCE_TOKENS = 131072
MAX_PROPOSE_TOKENS = 262144
# Features (EAGLE's input, ~1.1 KB a token for the default model) in one Propose, within the 16 MiB
# message bound: a longer prompt's go over several steps.
MAX_PROPOSE_FEATURE_BYTES = 12 * 1024 * 1024
MAX_RELEASE_SEQUENCES = 4096

# Speculative options (SpeculativeConfig.options): how many, and how long a name or string value.
MAX_OPTIONS = 32
MAX_OPTION_CHARS = 64
