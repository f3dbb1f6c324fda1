// Builds the shared precompiled header; no code.
