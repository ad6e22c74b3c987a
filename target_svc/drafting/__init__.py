"""Where a step's drafts come from: drafter services over gRPC (`remote`) and proposers that run
inside the target (`registry`), all behind one interface (`base`), gathered by `Drafters`."""
