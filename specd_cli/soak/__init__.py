"""`specd bench soak`: the real stack under steady load for a long while, with a drafter killed and a
storm of cancelled streams inside it, and what it must come back to: no request lost, memory flat, every
KV block and drafter sequence released."""
