"""What an inference engine imports to use drafter."""
