"""What a run tells its user: banner, warnings and metrics (`report`), held-out
evaluation (`evaluate`), plots (`plots`), the dry run (`dry_run`)."""
