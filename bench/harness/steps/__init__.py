"""The steps after the main scenarios, one module each; every step takes the run's context
(context.Context) and returns its figures, and a `*_text` function writes them as Markdown."""
