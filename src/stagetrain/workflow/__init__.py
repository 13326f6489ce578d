"""What the Snakemake workflow needs of the package: each stage script's shared edge (`stage`),
the code digest that reruns a stage when its code changes (`codedeps`), and Slurm (`slurm`)."""
