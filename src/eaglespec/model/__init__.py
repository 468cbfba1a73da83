"""The target model: layers, architecture, checkpoint loading and dequantization."""
