"""hearth.offload: memory planning, the pinned host expert store, the GPU expert cache and the tiered
indexer-key / latent stores. May import hearth.kernels; never hearth.engine or hearth.app."""
