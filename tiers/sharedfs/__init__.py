"""The shared-filesystem tier (`sharedfs`): one self-checking file per block in a directory many hosts mount."""
