# A GPU node group for an existing EKS cluster, and an EFS file system the pods share for
# checkpoints (mounted through the EFS CSI driver as the ReadWriteMany volume of
# ../kubernetes/pvc.yaml). Minimal on purpose: the cluster, its VPC and IAM roles exist.
#
# COST: every node is billed while it runs, training or not. The default, 2 x p4d.24xlarge
# (8 x A100 40 GB each), costs tens of US dollars per node-hour on demand (see README.md
# for the figure and where it comes from). `terraform destroy` when done; desired_size = 0
# keeps the group without paying for nodes.

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.0"
    }
  }
}

provider "aws" {
  region = var.region
}

resource "aws_eks_node_group" "gpu" {
  cluster_name    = var.cluster_name
  node_group_name = "${var.name}-gpu"
  node_role_arn   = var.node_role_arn
  subnet_ids      = var.subnet_ids
  instance_types  = [var.instance_type]
  ami_type        = "AL2023_x86_64_NVIDIA"
  capacity_type   = var.spot ? "SPOT" : "ON_DEMAND"
  disk_size       = 200

  scaling_config {
    desired_size = var.node_count
    min_size     = 0
    max_size     = var.max_node_count
  }

  labels = {
    "dtc/role" = "training"
  }

  taint {
    key    = "nvidia.com/gpu"
    value  = "present"
    effect = "NO_SCHEDULE"
  }
}

resource "aws_efs_file_system" "checkpoints" {
  creation_token   = "${var.name}-checkpoints"
  encrypted        = true
  performance_mode = "generalPurpose"
  throughput_mode  = "elastic"

  tags = {
    Name = "${var.name}-checkpoints"
  }
}

resource "aws_security_group" "efs" {
  name_prefix = "${var.name}-efs-"
  vpc_id      = var.vpc_id

  ingress {
    description = "NFS from the cluster's nodes"
    from_port   = 2049
    to_port     = 2049
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }
}

resource "aws_efs_mount_target" "checkpoints" {
  for_each        = toset(var.subnet_ids)
  file_system_id  = aws_efs_file_system.checkpoints.id
  subnet_id       = each.value
  security_groups = [aws_security_group.efs.id]
}
