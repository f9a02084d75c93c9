"""The run: built from a config (`build`), one iteration's stages (`iteration`), the
synchronous loop (`trainer`) and the asynchronous one (`async_rl`)."""
