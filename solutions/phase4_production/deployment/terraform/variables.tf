variable "region" {
  type        = string
  default     = "us-east-1"
  description = "AWS region of the cluster"
}

variable "name" {
  type        = string
  default     = "dtc"
  description = "Prefix of every resource's name"
}

variable "cluster_name" {
  type        = string
  description = "Name of the existing EKS cluster"
}

variable "node_role_arn" {
  type        = string
  description = "IAM role of the nodes (AmazonEKSWorkerNodePolicy, AmazonEKS_CNI_Policy, AmazonEC2ContainerRegistryReadOnly)"
}

variable "vpc_id" {
  type        = string
  description = "VPC of the cluster"
}

variable "vpc_cidr" {
  type        = string
  description = "CIDR block of the VPC (NFS is opened to it)"
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets for the nodes and the EFS mount targets"
}

variable "instance_type" {
  type        = string
  default     = "p4d.24xlarge"
  description = "GPU instance type (p4d.24xlarge: 8 x A100 40 GB; p5.48xlarge: 8 x H100)"
}

variable "node_count" {
  type        = number
  default     = 2
  description = "Nodes to run now (0: none, nothing billed for instances)"
}

variable "max_node_count" {
  type        = number
  default     = 4
  description = "Most nodes the group may scale to (the elastic PyTorchJob's maxReplicas)"
}

variable "spot" {
  type        = bool
  default     = false
  description = "Use spot capacity (cheaper, preemptible: the trainer checkpoints on SIGTERM)"
}
