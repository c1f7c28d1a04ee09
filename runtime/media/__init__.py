"""Runtime stage: media inputs (images) decoded and preprocessed into the records the engine and server pass around."""
