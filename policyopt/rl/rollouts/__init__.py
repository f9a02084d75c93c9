"""Generation's host side: a round's texts and sampling metrics (`rounds`), generation
beside an asynchronous trainer (`async_generation`)."""
