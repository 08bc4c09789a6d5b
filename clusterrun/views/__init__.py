"""What the user reads: the plain stream, the dashboard's model, ``ps``'s lists and documents, the GPU view."""
