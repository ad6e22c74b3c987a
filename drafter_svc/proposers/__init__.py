"""The proposers a drafter service can serve: `base` is the interface, `registry` lists them."""
