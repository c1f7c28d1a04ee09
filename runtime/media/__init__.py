"""Runtime stage: media inputs (images and videos) decoded and preprocessed into the records the engine and server pass
around."""
