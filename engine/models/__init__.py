"""Model code per architecture family, with Hugging Face module names so checkpoint keys map 1:1."""
