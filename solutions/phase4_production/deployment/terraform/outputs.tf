output "node_group" {
  value       = aws_eks_node_group.gpu.node_group_name
  description = "Name of the GPU node group"
}

output "efs_file_system_id" {
  value       = aws_efs_file_system.checkpoints.id
  description = "EFS id for the EFS CSI driver's StorageClass (fileSystemId) behind ../kubernetes/pvc.yaml"
}
